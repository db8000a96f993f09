"""Each prompt's seconds and own facts in a stage run: the manifest's `prompt_seconds`, `facts` and
`prompt_facts`."""

from __future__ import annotations

import json
from typing import Any


class PromptLog:
    """What each prompt of a set cost (its work's seconds, the shared set-up such as a model load not
    counted) and the facts its work set, in the order the prompts were done."""

    def __init__(self):
        self._seconds: dict[str, float] = {}
        self._facts: dict[str, str] = {}           # prompt -> its facts as compact JSON text

    def add(self, prompt_id: str, seconds: float, facts: dict[str, Any] | None = None) -> None:
        """A prompt's work: its seconds (a prompt done twice adds up) and the facts it set (None: none)."""
        self._seconds[prompt_id] = self._seconds.get(prompt_id, 0.0) + seconds
        if facts is not None:
            # As text, parsed again one prompt at a time when the manifest is written: 10,000 prompts' forward
            # facts are 44 MB as Python objects and 9 MB as text.
            self._facts[prompt_id] = json.dumps(facts, ensure_ascii=False, separators=(",", ":"))

    def seconds(self) -> dict[str, float]:
        """The manifest's `prompt_seconds`: each prompt's seconds, rounded to the millisecond."""
        return {pid: round(s, 3) for pid, s in self._seconds.items()}

    def facts(self, last: dict[str, Any]) -> dict[str, Any]:
        """The manifest's `facts` and, for a set whose prompts' facts differ, `prompt_facts`: `facts` holds
        what every prompt shares (a single prompt, or none logged: `last`, the facts the stage holds), and
        `prompt_facts` each prompt's own values of the others (otherwise the manifest would hold the last
        prompt's values as if they were the set's)."""
        per = self._facts
        if len(per) < 2:
            return {"facts": last}
        texts = iter(per.values())
        shared = json.loads(next(texts))
        for text in texts:                      # one prompt's facts in memory at a time
            f = json.loads(text)
            shared = {k: v for k, v in shared.items() if k in f and f[k] == v}
        own = {pid: {k: v for k, v in json.loads(text).items() if k not in shared} for pid, text in per.items()}
        return {"facts": shared, **({"prompt_facts": own} if any(own.values()) else {})}
