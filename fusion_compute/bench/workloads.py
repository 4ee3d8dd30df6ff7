"""The speculative-decoding bench's workloads (bench/speculative.py, bench/serve_cache.py), as data.

  input_grounded  the answer is in the prompt: summarise, extract, rewrite or copy from a given text,
                  fix a bug in given code. Prompt lookup (n-gram drafts) pays here: what the model
                  writes is largely what it was given.
  open_chat       open questions with nothing to copy from: drafts come only from the session's own
                  earlier tokens, and rarely pay. This is where the adaptive draft length must keep
                  speculation from costing anything.
  structured      the global suffix cache's workload (bench/serve_cache.py): the same JSON object
                  asked for about different people, so each answer repeats the earlier ones' keys
                  and punctuation; not in the speculative bench's sweep.

Written for this bench (no data set is downloaded), one user turn each, put in the bundled
SmolLM2-135M-Instruct's chat template by `prompt_ids` (the tokenizer the model ships). A module, not
JSON files: package data would need the packaging config to carry it, and this is read like code.
"""

from __future__ import annotations

from dataclasses import dataclass

_STORY = (
    "The harbour town of Kelso Bay was founded in 1852 by fishermen from the north coast. For most of "
    "its history the town lived on cod and herring, and by 1900 it had three canneries and a rail line "
    "to the capital. The collapse of the herring stocks in the 1970s closed two of the canneries within "
    "five years, and the population fell from 9,000 to just over 4,000. In 1994 the town council turned "
    "the last cannery into a maritime museum, and a ferry service to the islands began two years later. "
    "Today tourism employs more people than fishing, and the museum receives about 60,000 visitors a year."
)

_MEETING = (
    "Minutes of the project meeting, 14 March. Present: Alice Moreau (chair), Ben Okafor, Chen Wei and "
    "Dana Ruiz. Ben reported that the new billing service passed its load test at 2,000 requests per "
    "second. Chen will move the database to the new cluster on 28 March; the old cluster is switched off "
    "on 4 April. Dana asked for a second reviewer on every schema change, and the team agreed. Alice will "
    "send the budget to finance by 21 March. Next meeting: 28 March at 10:00."
)

_EMAIL = (
    "hey team, so the server is down again since like 3am and nobody noticed untill now which is bad. i "
    "think its the disk that is full again because the logs is not rotated. can someone pls look at it "
    "asap and also we need to fix the log rotation for real this time, not just delete stuff. thx, sam"
)

_CODE_MEAN = '''def mean(values):
    """Return the arithmetic mean of a list of numbers."""
    total = 0
    for i in range(1, len(values)):
        total += values[i]
    return total / len(values)'''

_CODE_MAX = '''def find_max(numbers):
    """Return the largest number in the list."""
    best = 0
    for n in numbers:
        if n > best:
            best = n
    return best'''

_CODE_JS = """function countWords(text) {
  const words = text.split(" ");
  let counts = {};
  for (let i = 0; i <= words.length; i++) {
    const w = words[i].toLowerCase();
    counts[w] = (counts[w] || 0) + 1;
  }
  return counts;
}"""

_CODE_CLASS = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop(0)

    def is_empty(self):
        return len(self.items) == 0"""

_RECIPE = (
    "Pancakes. Ingredients: 200 g flour, 2 eggs, 300 ml milk, 1 tablespoon sugar, a pinch of salt, 30 g "
    "butter. Method: mix the flour, sugar and salt in a bowl. Beat the eggs with the milk and pour them "
    "into the flour slowly, whisking until smooth. Melt the butter in a pan, add it to the batter, and "
    "let the batter rest for 20 minutes. Cook each pancake for about one minute on each side."
)

_POEM = (
    "The river runs beneath the hill,\n"
    "The mill wheel turns, the air is still,\n"
    "The evening light falls on the stone,\n"
    "And I walk down the road alone."
)

INPUT_GROUNDED: tuple[str, ...] = (
    f"Summarise the following text in three sentences.\n\n{_STORY}",
    f"From the meeting minutes below, list every action item with the person responsible and the date.\n\n{_MEETING}",
    f"Rewrite this email so that it is polite and has correct spelling and grammar. Keep all the facts.\n\n{_EMAIL}",
    f"Copy the following poem exactly, then give it a title.\n\n{_POEM}",
    f"This Python function has a bug. Fix the bug and show the corrected function.\n\n```python\n{_CODE_MEAN}\n```",
    f"This function returns the wrong answer when every number is negative. Fix it and show the whole "
    f"corrected function.\n\n```python\n{_CODE_MAX}\n```",
    f"This JavaScript function crashes. Find the bug, fix it, and show the corrected code.\n\n```javascript\n{_CODE_JS}\n```",
    f"The pop method of this Stack class removes the wrong item. Fix it and show the full class.\n\n```python\n{_CODE_CLASS}\n```",
    f"Extract the ingredients from this recipe as a bulleted list, one ingredient per line with its amount.\n\n{_RECIPE}",
    f"Answer using only the text below: in which year did the ferry service begin, and how many people "
    f"visit the museum each year? Quote the sentences you used.\n\n{_STORY}",
    f"Rewrite the following meeting minutes as a short bulleted list.\n\n{_MEETING}",
    f"Add type hints and a docstring example to this Python function, and show the full function.\n\n```python\n{_CODE_MEAN}\n```",
)

OPEN_CHAT: tuple[str, ...] = (
    "What are some good ways to stay focused while working from home?",
    "Why is the sky blue?",
    "Can you suggest a few ideas for a birthday party for a ten-year-old?",
    "What is the difference between a virus and a bacterium?",
    "How do I start learning to play the guitar?",
    "Write a short story about a robot who wants to become a gardener.",
    "What are the pros and cons of electric cars?",
    "Explain how a rainbow forms.",
    "What should I pack for a week-long hiking trip?",
    "Why do cats purr?",
    "Give me some tips for a job interview.",
    "What makes a good friend?",
)

# The global suffix cache's workload (docs/speculative.md): requests whose answers share a structure,
# as a service's repeated structured outputs do; each asks for the same JSON object about another
# person, so an answer repeats the keys and punctuation of the ones before it, not their values.
_PEOPLE = (
    "Maria Lopez, a 34-year-old nurse from Madrid who speaks Spanish and English",
    "Tom Becker, a 52-year-old carpenter from Hamburg who speaks German",
    "Aiko Tanaka, a 27-year-old software engineer from Osaka who speaks Japanese and English",
    "Samuel Okoye, a 41-year-old teacher from Lagos who speaks English, Yoruba and French",
    "Lena Novak, a 23-year-old student from Prague who speaks Czech, German and English",
    "Pierre Martin, a 66-year-old retired pilot from Lyon who speaks French and Italian",
)
STRUCTURED: tuple[str, ...] = tuple(
    f"Return only a JSON object with the keys name, age, city, occupation and languages (a list) for this person: {p}."
    for p in _PEOPLE
)

WORKLOADS: dict[str, tuple[str, ...]] = {
    "input_grounded": INPUT_GROUNDED,
    "open_chat": OPEN_CHAT,
    "structured": STRUCTURED,
}


@dataclass(frozen=True)
class Workload:
    name: str
    texts: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]  # each text in the model's chat template, as token ids


def load(name: str, tokenizer, limit: int | None = None) -> Workload:
    """The workload `name` (its first `limit` prompts) with every prompt in the tokenizer's chat
    template (a user turn, then the assistant's turn opened). Raises KeyError naming the workloads
    for an unknown one."""
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    texts = WORKLOADS[name][:limit]
    prompts = tuple(tuple(tokenizer.chat_ids([{"role": "user", "content": t}])) for t in texts)
    return Workload(name, texts, prompts)
