"""What a user serves, as head configurations: the built-in model table, Hugging Face
config.json files (hostile ones too), heads given by hand, tensor-parallel splits, and a
grid applied to them."""

import json

import pytest

from tuner.errors import TunerError
from tuner.workload import DecodeShape
from tuner.workload.models import (MODELS, Attention, apply_heads, attention_from_flags, model_attention, parse_tp,
                                   per_gpu_heads)

LLAMA_8B = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "sliding_window": None}
GEMMA_2_9B = {"model_type": "gemma2", "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
              "hidden_size": 3584, "sliding_window": 4096, "attn_logit_softcapping": 50.0}


def _config(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", " LLAMA-3.1-8B "])
def test_a_built_in_model_is_found_by_its_hub_name(name):
    assert model_attention(name) == (Attention(32, 8, 128),)


def test_a_config_file_gives_the_same_heads_as_the_table(tmp_path):
    assert model_attention(_config(tmp_path, LLAMA_8B)) == MODELS["llama-3.1-8b"]
    assert model_attention(_config(tmp_path, GEMMA_2_9B)) == MODELS["gemma-2-9b"]
    assert model_attention(str(tmp_path)) == MODELS["gemma-2-9b"]  # a directory holding config.json


def test_a_model_directory_named_as_a_built_in_model_is_read_not_looked_up(tmp_path, monkeypatch):
    """A fine-tuned model kept in ./llama-3.1-8b/ with 48/8 heads was swept at the table's
    32/8, without a word (a helper's review): a path that exists wins over the table."""
    model = tmp_path / "llama-3.1-8b"
    model.mkdir()
    _config(model, dict(LLAMA_8B, num_attention_heads=48, hidden_size=6144))
    monkeypatch.chdir(tmp_path)
    assert model_attention("llama-3.1-8b") == (Attention(48, 8, 128),)
    assert model_attention(str(model)) == (Attention(48, 8, 128),)
    monkeypatch.chdir(model)  # elsewhere the name is the table's
    assert model_attention("llama-3.1-8b") == (Attention(32, 8, 128),)


@pytest.mark.parametrize("types", ["full_attention", {"0": "full_attention"}, 5])
def test_layer_types_that_are_not_a_list_of_types_are_one_line(tmp_path, types):
    """A string ("full_attention") was ignored and the model read as sliding everywhere
    (win4095) (a helper's review)."""
    with pytest.raises(TunerError, match="layer_types must be a list"):
        model_attention(_config(tmp_path, dict(LLAMA_8B, sliding_window=4096, layer_types=types)))


def test_interleaved_sliding_layers_give_two_static_keys_and_a_window_a_model_turns_off_gives_none(tmp_path):
    full, sliding = model_attention(_config(tmp_path, GEMMA_2_9B))
    assert (full.window_left, sliding.window_left) == (-1, 4095) and full.softcap == sliding.softcap == 50.0
    qwen = {"model_type": "qwen2", "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
            "sliding_window": 131072, "use_sliding_window": False}
    assert model_attention(_config(tmp_path, qwen)) == (Attention(28, 4, 128),)
    only_sliding = dict(LLAMA_8B, sliding_window=4096, layer_types=["sliding_attention"] * 4)
    assert model_attention(_config(tmp_path, only_sliding)) == (Attention(32, 8, 128, 4095),)
    mistral_v01 = dict(LLAMA_8B, model_type="mistral", sliding_window=4096)  # every layer slides
    assert model_attention(_config(tmp_path, mistral_v01)) == (Attention(32, 8, 128, 4095),)


def test_a_multimodal_config_is_read_for_its_text_model_and_gpt_oss_has_sinks(tmp_path):
    assert model_attention(_config(tmp_path, {"model_type": "llava", "text_config": LLAMA_8B})) == MODELS["llama-3.1-8b"]
    gpt_oss = {"model_type": "gpt_oss", "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
               "hidden_size": 2880, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]}
    assert model_attention(_config(tmp_path, gpt_oss)) == MODELS["gpt-oss-20b"]


@pytest.mark.parametrize("change, says", [
    ({"num_attention_heads": None}, "num_attention_heads must be an integer"),
    ({"num_attention_heads": 10**40}, "num_attention_heads must be an integer"),
    ({"num_attention_heads": True}, "num_attention_heads must be an integer"),
    ({"num_attention_heads": "32"}, "num_attention_heads must be an integer"),
    ({"num_key_value_heads": 64}, "num_key_value_heads must be an integer"),
    ({"num_key_value_heads": 5}, "do not divide"),
    ({"hidden_size": 3200}, "head_dim 100 is not a multiple of 16"),
    ({"hidden_size": 4097}, "hidden_size 4097 is not a multiple of 32 heads"),  # (was rounded down to 128)
    ({"head_dim": 1e9}, "head_dim 1000000000.0 is not a multiple"),
    ({"sliding_window": -4}, "sliding_window must be an integer"),
    ({"sliding_window": 2**60}, "sliding_window must be an integer"),
    ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping must be a number"),
    ({"layer_types": ["sliding_attention", "chunked_attention"], "sliding_window": 8}, "layer_types holds"),
    ({"kv_lora_rank": 512}, "latent attention"),
])
def test_a_bad_config_is_one_line_that_names_the_field(tmp_path, change, says):
    data = {k: v for k, v in dict(LLAMA_8B, **change).items() if v is not None or k == "sliding_window"}
    with pytest.raises(TunerError, match=says) as e:
        model_attention(_config(tmp_path, data))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["[1, 2]", "not json", "{\"num_attention_heads\": " + "9" * 5000 + "}"])
def test_a_config_that_is_no_json_object_is_one_line(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(TunerError) as e:
        model_attention(str(tmp_path / "config.json"))
    assert "\n" not in str(e.value)


def test_an_unknown_model_name_lists_the_known_ones():
    with pytest.raises(TunerError, match="unknown model 'llama-9-9b'.*llama-3.1-8b"):
        model_attention("llama-9-9b")


def test_a_path_that_exists_but_gives_no_config_says_so(tmp_path):
    """They were called unknown model names."""
    with pytest.raises(TunerError, match="the directory holds no config.json"):
        model_attention(str(tmp_path))
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(TunerError, match="not a regular file"):
        model_attention(str(tmp_path / "zero"))


def test_tensor_parallel_sizes_split_the_heads_and_replicate_kv_heads_past_their_count():
    llama_70b = MODELS["llama-3.1-70b"]
    assert per_gpu_heads(llama_70b, parse_tp("1,2,8")) == [Attention(64, 8, 128), Attention(32, 4, 128),
                                                            Attention(8, 1, 128)]
    assert per_gpu_heads(MODELS["qwen3-30b-a3b"], (8,)) == [Attention(4, 1, 128)]  # 4 kv heads, each on 2 GPUs
    assert per_gpu_heads(MODELS["gpt-oss-20b"], (1, 1)) == list(MODELS["gpt-oss-20b"])
    # each refusal names the sizes that do fit (a habit's --tp 1,2,4,8 on a 28-head model)
    with pytest.raises(TunerError, match="tp 8 does not divide the 28 query heads .*tp sizes that fit: 1, 2, 4, 28$"):
        per_gpu_heads(MODELS["qwen2.5-7b"], (8,))
    with pytest.raises(TunerError, match="tp 3 neither divides the 8 kv heads.*fit: 1, 2, 4, 8, 24$"):
        Attention(24, 8, 128).per_gpu(3)


@pytest.mark.parametrize("text", ["", "0", "1,x", "1,128", "-2"])
def test_a_bad_tp_list_is_one_line(text):
    with pytest.raises(TunerError, match="--tp"):
        parse_tp(text)


def test_heads_by_hand():
    assert attention_from_flags("48/8", 128) == Attention(48, 8, 128)
    assert attention_from_flags("16/8", 256, window=4096, softcap=50.0, sinks=True) == Attention(16, 8, 256, 4095,
                                                                                                 50.0, True)
    for heads, dim, says in (("48", 128, "give query/kv heads"), ("48/7", 128, "must divide"),
                             ("99999999999/1", 128, "both 1-1024"), ("9" * 5000 + "/1", 128, "both 1-1024"),
                             ("8/16", 128, "must divide"), ("48/8", 100, "--head-dim 100")):
        with pytest.raises(TunerError, match=says):
            attention_from_flags(heads, dim)
    with pytest.raises(TunerError, match="--window 0"):
        attention_from_flags("48/8", 128, window=0)


def test_a_grid_applied_to_heads_keeps_its_batches_and_lengths_and_takes_their_static_keys():
    grid = [DecodeShape(batch=1, kv_len=64, lengths="serving"), DecodeShape(batch=4, kv_len=1024, q_len=2)]
    heads = [Attention(48, 8, 128), Attention(16, 8, 256, 4095, 50.0, True)]
    shapes = apply_heads(grid, heads, dtype="float16", page_size=16)
    assert [(s.batch, s.kv_len, s.q_len, s.lengths) for s in shapes] == [
        (1, 64, 1, "serving"), (4, 1024, 2, "full")] * 2
    assert {(s.num_q_heads, s.num_kv_heads, s.head_dim, s.window, s.softcap, s.sinks, s.dtype, s.page_size)
            for s in shapes} == {(48, 8, 128, (-1, -1), 0.0, False, "float16", 16),
                                 (16, 8, 256, (4095, 0), 50.0, True, "float16", 16)}
    assert apply_heads(grid, heads * 2) == apply_heads(grid, heads)  # the same shape is measured once


def test_qwen_sliding_layers_are_those_from_max_window_layers_on(tmp_path):
    """Hugging Face's Qwen 2 and 3 slide only the layers from max_window_layers on: a config
    with 21 of 28 full was read as sliding everywhere, and one with all 28 full too (a
    helper's walkthrough)."""
    qwen = {"model_type": "qwen2", "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
            "num_hidden_layers": 28, "sliding_window": 4096, "use_sliding_window": True}
    full, window = Attention(28, 4, 128), Attention(28, 4, 128, 4095)
    assert model_attention(_config(tmp_path, dict(qwen, max_window_layers=21))) == (full, window)
    assert model_attention(_config(tmp_path, dict(qwen, max_window_layers=28))) == (full,)
    assert model_attention(_config(tmp_path, dict(qwen, max_window_layers=0))) == (window,)
    with pytest.raises(TunerError, match="num_hidden_layers"):
        model_attention(_config(tmp_path, {k: v for k, v in dict(qwen, max_window_layers=3).items()
                                           if k != "num_hidden_layers"}))


def test_config_files_as_hugging_face_writes_them_are_read(tmp_path):
    """A null num_key_value_heads means as many as the query heads (Hugging Face's reading);
    a UTF-8 byte-order mark is not text. Both were refused (a helper's walkthrough)."""
    assert model_attention(_config(tmp_path, dict(LLAMA_8B, num_key_value_heads=None))) == (Attention(32, 32, 128),)
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(LLAMA_8B).encode())
    assert model_attention(str(path)) == (Attention(32, 8, 128),)
    huge = tmp_path / "huge.json"
    huge.write_text('{"num_attention_heads": ' + "9" * 5001 + "}")
    with pytest.raises(TunerError, match="thousands of digits") as refused:
        model_attention(str(huge))
    assert "sys." not in str(refused.value)


@pytest.mark.parametrize("model", ["/models/llama/confg.json", "./llama", "~/no-such-model-dir", "my.json"])
def test_a_path_that_does_not_exist_is_said_to_be_missing_not_an_unknown_model(model):
    with pytest.raises(TunerError, match="no such file or directory"):
        model_attention(model)


def test_an_empty_model_is_refused_not_read_from_the_current_directory(tmp_path, monkeypatch):
    """An unset $MODEL (--model "") read ./config.json and swept it (a helper's walkthrough)."""
    _config(tmp_path, GEMMA_2_9B)
    monkeypatch.chdir(tmp_path)
    for empty in ("", "  "):
        with pytest.raises(TunerError, match="--model is empty"):
            model_attention(empty)
