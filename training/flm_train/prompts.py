"""Chat prompts for self-distillation from our own sources (no download, no MT-Bench).

The draft must learn how *the target* continues chat answers, so what matters is that the prompts
ask for the same kinds of chat use users bring (and that MT-Bench's eight categories sample):
writing, roleplay, reasoning, math, coding, extraction, STEM, humanities; the answers themselves
come from the target. Three sources (``SOURCES``), mixed in order by ``make_prompts``:

- ``templates`` (this module): a few dozen one-sentence instruction templates per category of our
  own wording, filled from topic lists of our own, drawn with a fixed seed;
- ``composed`` (``flm_train.composed_prompts``): longer requests built from parts (constraints,
  formats, personas, invented data and standard-library text pasted in);
- ``open`` (``flm_train.open_prompts``): the same kinds of requests over a bank of over four
  hundred everyday topics, for breadth.

``overlap_report`` checks that no prompt shares an 8-gram with an MT-Bench question (the
pipeline refuses to continue otherwise; see docs/training.md).
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from flm_train import composed_prompts, open_prompts

TOPICS = [
    "renewable energy", "urban gardening", "the history of the printing press", "coral reefs",
    "remote work", "electric bicycles", "ancient Rome", "volcanoes", "personal budgeting",
    "machine learning", "the water cycle", "public libraries", "chess openings", "bread baking",
    "space telescopes", "honeybees", "the Silk Road", "recycling plastics", "marathon training",
    "jazz music", "the human immune system", "smartphone photography", "desert ecosystems",
    "the French Revolution", "board games", "composting", "black holes", "minimalist living",
    "the Industrial Revolution", "sleep hygiene", "container shipping", "origami", "glaciers",
    "open-source software", "the Renaissance", "tea culture", "wind turbines", "mountain hiking",
    "online privacy", "the Great Barrier Reef", "medieval castles", "electric cars",
    "learning a second language", "the stock market", "birdwatching", "solar eclipses",
    "3D printing", "the Olympic Games", "vaccines", "rainforests", "time management",
    "the invention of the telephone", "street food", "earthquakes", "video game design",
    "classical architecture", "climate adaptation", "public speaking", "the Moon landing",
    "vertical farming", "ocean tides", "the Roman aqueducts", "coffee farming", "cybersecurity",
]

AUDIENCES = ["a ten-year-old", "a busy parent", "a first-year university student", "a retired engineer",
             "a small business owner", "a high school teacher", "a tourist", "a new employee"]

TEMPLATES: dict[str, list[str]] = {
    "writing": [
        "Write a short blog post about {topic} for {audience}.",
        "Write a persuasive paragraph arguing that more people should learn about {topic}.",
        "Compose a poem of four stanzas inspired by {topic}.",
        "Write a friendly newsletter introduction announcing a community event about {topic}.",
        "Draft a polite email to a colleague asking for help preparing a presentation on {topic}.",
        "Write a short story in which the main character discovers something surprising about {topic}.",
        "Write a product description for a new book about {topic}.",
        "Give me three catchy titles for an article about {topic}, then explain which one you prefer.",
        "Write a motivational speech opening about {topic} for {audience}.",
        "Summarize the main ideas of {topic} in one clear paragraph.",
        "Write a diary entry from the point of view of someone who works with {topic}.",
        "Write a short review of an imaginary museum exhibition on {topic}.",
    ],
    "roleplay": [
        "Pretend you are a tour guide. Introduce a group of visitors to {topic}.",
        "Act as a patient teacher and explain {topic} to {audience}.",
        "You are a radio host. Open today's show, whose theme is {topic}.",
        "Imagine you are a scientist being interviewed about {topic}. Answer the first question: why does it matter?",
        "Play the role of a travel agent recommending a trip themed around {topic}.",
        "Pretend to be a wise old librarian recommending books about {topic} to {audience}.",
        "You are a coach giving a pep talk to a team that is working on a project about {topic}.",
        "Act as a museum curator describing the most interesting object in a collection about {topic}.",
        "Imagine you are a detective who must solve a mystery connected to {topic}. Describe your first clue.",
        "You are a chef. Describe a dinner menu inspired by {topic}.",
    ],
    "reasoning": [
        "What are the main advantages and disadvantages of {topic}? Reason step by step.",
        "A friend claims that {topic} is not important. How would you respond, and why?",
        "List three common misconceptions about {topic} and explain why each one is wrong.",
        "If a city wanted to invest in {topic}, what factors should it consider first? Explain your reasoning.",
        "Compare {topic} with {topic2}: what do they have in common and how do they differ?",
        "Explain the cause-and-effect relationships involved in {topic}.",
        "What questions would you ask an expert to quickly understand {topic}?",
        "Give a logical argument for and against spending public money on {topic}.",
    ],
    "math": [
        "A train travels {a} kilometers in {b} hours. What is its average speed? Show your work.",
        "Solve for x: {a}x + {b} = {c}. Explain each step.",
        "What is {a} percent of {c}? Show how you computed it.",
        "A rectangle has a length of {a} cm and a width of {b} cm. Find its area and perimeter.",
        "If I save {a} dollars every week, how much will I have after {b} weeks?",
        "What is the sum of all integers from 1 to {c}? Explain the method.",
        "A shop sells pencils at {b} for {a} cents. How much do {c} pencils cost?",
        "Find the greatest common divisor of {a} and {c}, and explain the algorithm you used.",
        "Is {c} a prime number? Explain how to check.",
        "Convert {c} minutes into hours and minutes.",
        "A recipe needs {b} eggs for {a} people. How many eggs are needed for {c} people?",
        "Compute the mean and the median of these numbers: {a}, {b}, {c}, {d}, {e}.",
    ],
    "coding": [
        "Write a Python function that {task}.",
        "Write a JavaScript function that {task}.",
        "Explain how you would write a program that {task}, then give the code in Python.",
        "Write a short Python script that {task}, with comments.",
        "What is a simple algorithm that {task}? Give its time complexity.",
        "Write a C function that {task}.",
        "Write a unit test in Python for a function that {task}.",
    ],
    "extraction": [
        "Extract all the names of people and places from this text: \"{sentence}\"",
        "Read this sentence and list its key facts as bullet points: \"{sentence}\"",
        "Classify the sentiment of this review as positive, negative or neutral, and explain: \"{review}\"",
        "Turn the following information into a JSON object with sensible keys: \"{sentence}\"",
        "Identify the main topic and the tone of this passage: \"{review}\"",
        "Rewrite this sentence in simpler words: \"{sentence}\"",
    ],
    "stem": [
        "Explain how {science} works in simple terms.",
        "What is {science}, and why is it important in everyday life?",
        "Describe an experiment that could demonstrate {science}.",
        "What are the key equations or principles behind {science}?",
        "How did scientists first discover {science}?",
        "Explain {science} to {audience}.",
    ],
    "humanities": [
        "What were the main causes and consequences of {history}?",
        "Describe the cultural impact of {history}.",
        "How is {history} taught in schools, and what lessons can we learn from it?",
        "Explain the key ideas of {philosophy} and give an everyday example.",
        "What would {philosopher} say about modern social media? Discuss briefly.",
        "Compare the economic ideas of {economist} with those of a modern economist.",
        "Why do people still study {history} today?",
    ],
}

CODING_TASKS = [
    "reverses a string", "checks whether a word is a palindrome", "counts the vowels in a sentence",
    "returns the largest number in a list", "computes the factorial of n", "merges two sorted lists",
    "removes duplicates from a list while keeping order", "computes the n-th Fibonacci number",
    "checks whether a number is prime", "converts Celsius to Fahrenheit", "finds the most common word in a text",
    "sorts a list of dictionaries by a key", "reads a CSV file and prints the average of a column",
    "validates a simple email address", "flattens a nested list", "counts the words in a file",
    "implements binary search on a sorted list", "returns the second smallest element of a list",
    "capitalizes the first letter of every word", "computes the GCD of two numbers",
]
SCIENCE = [
    "photosynthesis", "gravity", "electricity", "the greenhouse effect", "DNA replication", "plate tectonics",
    "nuclear fusion", "magnetism", "the Doppler effect", "evolution by natural selection", "sound waves",
    "chemical bonds", "the speed of light", "antibiotics", "semiconductors", "entropy", "osmosis",
    "the periodic table", "radioactive decay", "neural networks", "buoyancy", "friction", "the ozone layer",
]
HISTORY = [
    "the fall of the Western Roman Empire", "the invention of the printing press", "the Industrial Revolution",
    "the Renaissance in Italy", "the voyages of Magellan", "the building of the Great Wall of China",
    "the Meiji Restoration", "the abolition of slavery in the British Empire", "the Cold War",
    "the first Olympic Games", "the Black Death", "the construction of the pyramids of Giza",
]
PHILOSOPHY = ["stoicism", "utilitarianism", "existentialism", "Confucian ethics", "empiricism", "pragmatism"]
PHILOSOPHERS = ["Aristotle", "Confucius", "Immanuel Kant", "Simone de Beauvoir", "John Stuart Mill", "Epictetus"]
ECONOMISTS = ["Adam Smith", "John Maynard Keynes", "David Ricardo", "Friedrich Hayek"]
SENTENCES = [
    "Maria Lopez flew from Madrid to Toronto on Monday to present her research on river pollution.",
    "The new library in Springfield opens at 9 a.m., has 40,000 books and was designed by Kenji Sato.",
    "On 3 May, the town council of Oakridge approved a budget of 2 million dollars for new bike lanes.",
    "Professor Amina Diallo and her students found three new species of beetle in the forests of Gabon.",
    "The bakery on Elm Street, owned by Tom Becker, sells 500 loaves a day and closes on Sundays.",
    "Lena and Omar drove from Berlin to Prague, stopping in Dresden to visit the Zwinger palace.",
]
REVIEWS = [
    "The hotel room was spotless and the staff were kind, but the breakfast was cold every morning.",
    "I waited forty minutes for my order and the soup tasted like water. I will not be back.",
    "This laptop is light, fast and the battery lasts all day. Best purchase I made this year.",
    "The film had gorgeous scenery, although the story dragged in the middle.",
    "The museum was fine. Some rooms were interesting, others were closed.",
]

_NUMS = [3, 4, 5, 6, 7, 8, 9, 12, 15, 18, 24, 25, 36, 42, 48, 60, 72, 84, 96, 120, 144, 150, 240, 360]


def _fill(template: str, rng: random.Random) -> str:
    topic, topic2 = rng.sample(TOPICS, 2)
    a, b, c, d, e = rng.sample(_NUMS, 5)
    return template.format(
        topic=topic, topic2=topic2, audience=rng.choice(AUDIENCES), a=a, b=b, c=c, d=d, e=e,
        task=rng.choice(CODING_TASKS), science=rng.choice(SCIENCE), history=rng.choice(HISTORY),
        philosophy=rng.choice(PHILOSOPHY), philosopher=rng.choice(PHILOSOPHERS),
        economist=rng.choice(ECONOMISTS), sentence=rng.choice(SENTENCES), review=rng.choice(REVIEWS))


def _template_prompt(category: str, rng: random.Random) -> str:
    return _fill(rng.choice(TEMPLATES[category]), rng)


def _by_category(generators: dict[str, Callable[[random.Random], str]]) -> Callable[[str, random.Random], str]:
    """A source from a module's one-generator-per-category table (``GENERATORS``)."""
    return lambda category, rng: generators[category](rng)


SOURCES: dict[str, Callable[[str, random.Random], str]] = {
    "templates": _template_prompt, "composed": _by_category(composed_prompts.GENERATORS),
    "open": _by_category(open_prompts.GENERATORS)}


def parse_mix(spec: str) -> list[tuple[str, int]]:
    """``"templates:2048,composed:1536"`` -> ``[("templates", 2048), ("composed", 1536)]``.

    Raises:
        ValueError: an unknown source, a count that is not a positive integer, or an empty spec.
    """
    mix = []
    for part in filter(None, (x.strip() for x in spec.split(","))):
        source, _, count = part.partition(":")
        if source not in SOURCES:
            raise ValueError(f"unknown prompt source {source!r} (known: {', '.join(SOURCES)})")
        if not count.isdigit() or int(count) <= 0:
            raise ValueError(f"{part!r}: the count after {source}: must be a positive integer")
        mix.append((source, int(count)))
    if not mix:
        raise ValueError("empty prompt mix")
    return mix


def source_prompts(source: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct ``(category, prompt)`` of one source, categories in equal turns.

    Deterministic in ``seed`` and prefix-stable: ``source_prompts(s, k) == source_prompts(s, n)[:k]``.

    Raises:
        ValueError: the source gives fewer than ``n`` distinct prompts.
    """
    make = SOURCES[source]
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    cats = itertools.cycle(sorted(TEMPLATES))
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n:
            raise ValueError(f"n={n} is more distinct prompts than the {source} source gives")
        cat = next(cats)
        text = make(cat, rng)
        if text in seen:
            continue
        seen.add(text)
        out.append((cat, text))
    return out


def make_prompts(mix: list[tuple[str, int]], seed: int = 0) -> list[dict]:
    """The prompts ``{"id", "source", "category", "prompt"}`` of ``mix`` (``parse_mix``), sources in order.

    Prefix-stable like ``source_prompts``: growing the last source's count, or appending a source,
    extends the same list, so the shards already generated stay valid.
    """
    out: list[dict] = []
    for source, n in mix:
        for cat, text in source_prompts(source, n, seed):
            out.append({"id": len(out), "source": source, "category": cat, "prompt": text})
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def load_mt_bench(path: str | Path) -> list[str]:
    """All turns of the MT-Bench questions file (jsonl with a ``turns`` list per line)."""
    turns = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            turns.extend(json.loads(line)["turns"])
    return turns


def overlap_report(prompts: list[str], mt_bench: list[str], n: int = 8) -> list[tuple[str, str]]:
    """(prompt, MT-Bench turn) pairs that are equal (case/punctuation-folded) or share an n-gram."""
    bench = [(t, ngrams(t, n), " ".join(_words(t))) for t in mt_bench]
    hits = []
    for p in prompts:
        pg, pw = ngrams(p, n), " ".join(_words(p))
        for t, tg, tw in bench:
            if pw == tw or pg & tg:
                hits.append((p, t))
    return hits
