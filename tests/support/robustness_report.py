"""What the robustness and property suites tried, written to $TUNER_ROBUSTNESS_REPORT (a
JSON file) when that is set; benchmarks/results/cpu/robustness.json is one such run."""

import json
import os
from pathlib import Path


def report(name: str, **facts) -> None:
    path = os.environ.get("TUNER_ROBUSTNESS_REPORT")
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[name] = facts
    p.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


class Counter:
    """Cases tried and refused by one suite."""

    def __init__(self, name: str, **facts) -> None:
        self.name, self.cases, self.refused, self.facts = name, 0, 0, facts

    def tried(self, n: int = 1) -> None:
        self.cases += n

    def rejected(self, yes: bool | int = True) -> None:
        self.refused += int(yes)

    def report(self, tests_failed: int) -> None:
        """The counts; the facts (crashes 0 and those given) only from tests that all passed,
        since those tests assert them."""
        if tests_failed:
            report(self.name, tests_failed=tests_failed)
            return
        report(self.name, cases=self.cases, refused_with_one_line_error=self.refused,
               accepted=self.cases - self.refused, crashes=0, **self.facts)
