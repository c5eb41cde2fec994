"""Property-based tests (hypothesis): the key builders and the JSON importer take any input
and either give a valid key / import, or raise one clear error; the DB never changes on a
bad document. Plus two source checks: no pickle, and SQL text only as constants (values
go through bound parameters).

With TUNER_ROBUSTNESS_REPORT=path, each test adds how many cases it tried (see
tests/test_robustness.py)."""

import ast
import copy
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.robustness_report import Counter
from tuner.db import TuningDB, export_document, import_document
from tuner.errors import TunerError
from tuner.keys import AttentionStaticKey, attention_run_key, kv_len_bucket, static_key_from_parts

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# -- key builders ------------------------------------------------------------------------------

ints = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**40, 2**62, 2**62 + 1, 2**63]))
anything = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=8),
                     st.lists(ints, max_size=3), st.tuples(ints, ints), st.dictionaries(st.text(max_size=3), ints,
                                                                                        max_size=2))
windows = st.one_of(st.none(), ints, st.tuples(ints, ints), st.lists(ints, max_size=4), anything)
softcaps = st.one_of(st.none(), st.just(0), st.just(0.0), st.floats(allow_nan=True, allow_infinity=True), anything)

KEYS = Counter("key_builders")


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    """After this file's tests: write the counts they collected (not a test: it asserts nothing).
    What the counts claim (no crash, no DB changed by a refusal) the tests assert, so it is
    written only where none of them failed."""
    failed_before = request.session.testsfailed
    yield
    failed = request.session.testsfailed - failed_before
    KEYS.report(failed)
    IMPORTS.report(failed)


@SETTINGS
@given(window=windows, softcap=softcaps, sinks=anything, causal=anything, heads=ints, page=ints)
def test_static_keys_are_valid_or_one_clear_value_error(window, softcap, sinks, causal, heads, page):
    KEYS.tried()
    try:
        key = static_key_from_parts(
            q_dtype="bfloat16", k_dtype="bfloat16", v_dtype="bfloat16", num_q_heads=heads, num_kv_heads=8,
            head_dim_qk=128, head_dim_v=128, page_size=page, causal=causal, window_size=window,
            softcap=softcap, sinks=sinks, k_descale=False, v_descale=False,
        )
    except (ValueError, TypeError, OverflowError) as e:
        assert isinstance(e, ValueError), f"{type(e).__name__}: {e}"
        assert str(e) and "\n" not in str(e)
        KEYS.rejected()
        return
    assert AttentionStaticKey.from_json(key.to_json()) == key
    assert key.window_left >= -1 and key.window_right >= -1
    assert isinstance(key.softcap, bool) and key.softcap == (softcap is not None and softcap > 0)
    assert key.num_q_heads == heads >= 1 and key.page_size == page >= 0


@SETTINGS
@given(batch=ints, q=ints, kv=ints)
def test_run_keys_take_kv_up_to_2_62_and_refuse_the_rest_clearly(batch, q, kv):
    KEYS.tried()
    try:
        key = attention_run_key(batch, q, kv)
    except ValueError as e:
        assert str(e) and "\n" not in str(e)
        assert not (1 <= batch <= 2**62 and 1 <= q <= 2**62 and 0 <= kv <= 2**62)
        KEYS.rejected()
        return
    assert key.kv_len_bucket == kv_len_bucket(kv) >= kv and key.kv_len_bucket & (key.kv_len_bucket - 1) == 0


# -- the JSON importer -------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(allow_nan=False),
              st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=30,
)

IMPORTS = Counter("json_importer", db_changed_by_a_refused_import=0)


@pytest.fixture(scope="module")
def valid_document(tmp_path_factory):
    from tuner.db import Problem, current_fingerprint, current_fingerprint_id
    from tuner.keys import attention_run_key as run

    db = TuningDB(tmp_path_factory.mktemp("doc") / "doc.db")
    fp = (current_fingerprint_id(), current_fingerprint())
    for i in range(3):
        db.save_record(Problem("op", json.dumps({"h": i}), run(1 + i, 1, 64)), fp, {"c": i}, median_us=1.0 + i,
                       spread_us=0.1, samples=5, default_config={"c": 0}, default_median_us=2.0,
                       default_spread_us=0.1, method={"timer": "x"})
    return export_document(db)


def _paths(doc, prefix=()):
    """Every (container, key) in a JSON document, to mutate one place at a time."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield doc, k
            yield from _paths(v)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield doc, i
            yield from _paths(v)


def _check_import(db_path, document):
    db = TuningDB(db_path)
    before = sorted((repr(r.problem), json.dumps(r.config)) for r in db.records())
    try:
        n = import_document(db, document)
    except TunerError as e:
        assert str(e) and "\n" not in str(e), repr(e)
        after = sorted((repr(r.problem), json.dumps(r.config)) for r in db.records())
        assert after == before  # nothing written on a bad document
        db.close()
        return False
    from tuner.db.jsonio import parse_document

    assert n.total == len(parse_document(document))  # one per key: the newest of any given twice
    db.close()
    return True


@SETTINGS
@given(document=json_values)
def test_arbitrary_json_is_refused_with_one_line_and_the_db_unchanged(tmp_path, document):
    IMPORTS.tried()
    accepted = _check_import(tmp_path / "arbitrary.db", document)
    assert not accepted or isinstance(document, dict)
    IMPORTS.rejected(not accepted)


@SETTINGS
@given(data=st.data(), replacement=json_values)
def test_one_field_of_a_valid_document_mutated(tmp_path, valid_document, data, replacement):
    IMPORTS.tried()
    document = copy.deepcopy(valid_document)
    places = list(_paths(document))
    container, key = places[data.draw(st.integers(0, len(places) - 1))]
    action = data.draw(st.sampled_from(["replace", "delete", "add_unknown"]))
    if action == "replace":
        container[key] = replacement
    elif action == "delete":
        del container[key]
    elif isinstance(container, dict):
        container["unknown_" + str(key)] = replacement
    else:
        container.append(replacement)
    IMPORTS.rejected(not _check_import(tmp_path / "mutated.db", document))


@pytest.mark.parametrize("depth", [50, 1000, 100_000])
def test_deeply_nested_and_huge_documents_are_refused_clearly(tmp_path, depth):
    from tuner.db.jsonio import load_document

    f = tmp_path / "deep.json"
    f.write_text("[" * depth + "]" * depth)
    db = TuningDB(tmp_path / "deep.db")
    with pytest.raises(TunerError) as e:
        import_document(db, load_document(f))
    assert "\n" not in str(e.value)
    f.write_text(json.dumps({"schema": "tuner.tunings", "version": 1, "fingerprints": {},
                             "records": [{"op": "x" * 10**6}]}))
    with pytest.raises(TunerError):
        import_document(db, load_document(f))
    assert db.records() == []
    IMPORTS.tried(2)
    IMPORTS.rejected(2)


# -- source checks ---------------------------------------------------------------------------

SOURCE = Path(__file__).resolve().parents[1] / "tuner"


def test_no_pickle_anywhere():
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("pickle", "dill", "cloudpickle", "shelve") for n in names), path
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads") and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                pytest.fail(f"{path}: torch.load unpickles")


def test_sql_text_is_constant_so_values_go_through_bound_parameters():
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("text", "exec_driver_sql", "execute") and node.args:
                arg = node.args[0]
                if isinstance(arg, (ast.JoinedStr, ast.BinOp)) or (
                        isinstance(arg, ast.Call) and getattr(arg.func, "attr", "") == "format"):
                    pytest.fail(f"{path}:{node.lineno}: SQL built from a formatted string")


