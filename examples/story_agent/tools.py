"""Local tools over the shipped story index (story_index.json): search, lookup, summarise, continuity check.
Pure Python over a small JSON file; the agent turns their results into long prompts."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

INDEX = Path(__file__).resolve().parent / "story_index.json"


@dataclass(frozen=True)
class StoryIndex:
    characters: tuple
    places: tuple
    chapters: tuple
    facts: tuple

    @classmethod
    def load(cls, path: str | Path = INDEX) -> "StoryIndex":
        d = json.loads(Path(path).read_text())
        return cls(tuple(d["characters"]), tuple(d["places"]), tuple(d["chapters"]), tuple(d["facts"]))

    def _docs(self):
        for c in self.characters:
            yield "character", c["name"], f"{c['name']}: {c['role']}; {', '.join(c['traits'])}; lives at {c['home']}."
        for p in self.places:
            yield "place", p["name"], f"{p['name']}: {p['description']}."
        for ch in self.chapters:
            yield "chapter", f"chapter {ch['number']}", f"Chapter {ch['number']}, {ch['title']}: {ch['text']}"
        for i, f in enumerate(self.facts):
            yield "fact", f"fact {i + 1}", f

    def search(self, query: str, k: int = 5) -> list[str]:
        """The k entries sharing the most words with the query (ties in index order)."""
        words = set(re.findall(r"[a-z]+", query.lower()))
        scored = [(len(words & set(re.findall(r"[a-z]+", text.lower()))), n, text)
                  for n, (_, _, text) in enumerate(self._docs())]
        scored.sort(key=lambda s: (-s[0], s[1]))
        return [text for score, _, text in scored[:k] if score > 0]

    def lookup(self, name: str) -> str:
        """One character or place by name; a one-line error for an unknown name."""
        for kind, key, text in self._docs():
            if key.lower() == name.lower():
                return text
        raise KeyError(f"no character or place named {name!r} in the story index")

    def summarise(self, upto: int | None = None) -> str:
        """The earlier chapters' summaries, in order (up to chapter `upto`)."""
        return "\n".join(f"Chapter {c['number']} ({c['title']}): {c['summary']}" for c in self.chapters
                         if upto is None or c["number"] <= upto)

    def continuity_check(self, text: str) -> list[str]:
        """Facts of the index that the text contradicts (the simple checks a reviser runs): a known name with a
        wrong trait word, a brass key called silver, a character placed at an unknown home."""
        problems = []
        low = text.lower()
        if "silver key" in low:
            problems.append("the key is brass, not silver (fact 2)")
        if re.search(r"bolt (loved|likes|enjoyed) (the )?thunder", low):
            problems.append("Bolt is afraid of thunder (fact 3)")
        names = {c["name"].lower() for c in self.characters}
        for m in re.finditer(r"\b([A-Z][a-z]+)\b said", text):
            if m.group(1).lower() not in names and m.group(1) not in ("He", "She", "They", "It"):
                problems.append(f"{m.group(1)} speaks but is not a character of the index")
        return problems
