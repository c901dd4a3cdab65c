"""The ``composed`` prompt source: chat requests built from parts, closer to what users send.

The ``templates`` source (``flm_train.prompts``) asks one short thing per prompt. Real chat
requests (and MT-Bench's first turns) are longer: several parts, constraints on length, tone or
format, a persona to keep, data or code pasted in to work on. Each generator here composes one
such request from our own word banks and procedurally invented material (names, numbers, tables,
meeting notes, small programs), so the same few words never repeat across thousands of prompts.
Pasted prose and code also come from docstrings and short functions of Python's standard library
(``stdlib_passages``): real technical text, present on every machine that runs the pipeline. Its
exact text depends on the Python version, which is why the pipeline keeps the prompts it made in
``prompts.jsonl`` and refuses to continue on a list that no longer matches it.

Nothing here is drawn from MT-Bench; the pipeline's 8-gram check runs on these prompts too.
"""

from __future__ import annotations

import importlib
import inspect
import random
import textwrap
from collections.abc import Callable
from functools import cache

# --- word banks (our own) ----------------------------------------------------------------------

SUBJECTS = [
    "a neighbourhood repair café", "night trains in Europe", "the first year of owning a dog", "learning to swim as an adult",
    "a small bookshop that survived online competition", "public transport in a mid-sized city", "home solar panels",
    "a community orchestra", "how lighthouses work", "keeping houseplants alive", "the history of the bicycle",
    "a family recipe passed down for generations", "volunteering at an animal shelter", "a trip to Iceland in winter",
    "moving to a new country", "the science of sourdough", "running a school science fair", "saving money on groceries",
    "a robot vacuum cleaner", "the life of a beekeeper", "a weekend hiking trip in the Alps", "starting a podcast",
    "digital detox weekends", "the invention of the microwave oven", "an electric scooter sharing scheme",
    "a rooftop farm in a big city", "retro video game consoles", "learning the piano at fifty", "a local farmers' market",
    "working night shifts in a hospital", "the restoration of an old cinema", "a smartwatch for runners",
    "a mobile library bus", "choosing a first programming language", "the migration of monarch butterflies",
    "a new tram line", "wildfire prevention", "a coffee roastery", "the first day at a new job", "tidal power",
    "handwritten letters", "a chess club for seniors", "a noise-cancelling headphone launch", "city parks in summer",
    "an open-air museum", "a marathon for charity", "water shortages in dry regions", "a language exchange meetup",
]
AUDIENCES = [
    "teenagers", "retirees", "busy parents", "first-time visitors", "software engineers", "small business owners",
    "nurses", "university students", "people who have never heard of it", "a sceptical manager", "investors",
    "primary school children", "my grandmother", "a hiring committee", "city council members", "new employees",
]
FORMS = [
    "blog post", "newsletter section", "speech", "cover letter", "press release", "short story", "poem",
    "product description", "letter to the editor", "travel guide entry", "FAQ page", "podcast episode introduction",
    "wedding toast", "thank-you note", "social media thread", "opinion column", "fairy tale", "advertisement",
    "museum placard", "welcome message for a website",
]
LENGTHS = ["short", "two-paragraph", "150-word", "300-word", "detailed", "one-page", "three-paragraph", "concise"]
CONSTRAINTS = [
    "Use a warm, conversational tone.", "Avoid technical jargon.", "End with a question for the reader.",
    "Mention at least two concrete examples.", "Keep every sentence under twenty words.", "Open with a vivid anecdote.",
    "Write in the second person.", "Add a touch of humour, but stay respectful.", "Do not use the letter 'z' anywhere.",
    "Include a call to action at the end.", "Make it sound professional but friendly.", "Use exactly three paragraphs.",
    "Include one surprising fact and say where a reader could check it.", "Write it so it can be read aloud in one minute.",
    "Use simple words a twelve-year-old would understand.", "Give it a memorable title.", "Avoid clichés.",
    "Include a short quote from an imaginary expert.", "Use British spelling.", "Make the ending hopeful.",
]
FORMATS = [
    "Format the answer in Markdown with headings.", "Use bullet points where it helps.", "Number each step.",
    "Put the most important sentence in bold.", "Finish with a one-line summary.", "Present it as a table, then comment on it.",
    "Return only the final text, without explanations.", "Give two versions: a formal one and a casual one.",
    "Start with a one-sentence overview.", "Label each part clearly.",
]
PERSONAS = [
    "a grumpy but kind lighthouse keeper", "a nineteenth-century sea captain", "a cheerful kindergarten teacher",
    "a medieval blacksmith", "a startup founder pitching to investors", "an enthusiastic football commentator",
    "a patient customer support agent for an internet provider", "a strict but fair fitness coach",
    "a detective in 1920s London", "a visitor from another planet seeing Earth for the first time",
    "a famous pastry chef", "a park ranger in a national park", "a Shakespearean actor", "a wise old gardener",
    "a nervous first-time tour guide", "a robot learning human manners", "a time traveller from the year 2300",
    "a ship's cat who can talk", "a calm airline pilot", "a street musician", "a retired astronaut",
    "a village baker who knows everyone's secrets", "a museum night guard", "a travelling bookseller",
]
PERSONA_OPENERS = [
    "From now on you are {persona}. Stay in character for the whole conversation.",
    "Play the part of {persona}. Answer as that character would, without explaining that you are playing a role.",
    "I want you to act as {persona}. Keep the character's voice in every answer.",
    "You are {persona}. Do not break character.",
]
PERSONA_QUESTIONS = [
    "What does a normal day look like for you?", "What is the best advice you ever received?",
    "Tell me about the hardest decision you have made.", "What do you think of {subject}?",
    "How would you explain {science} to me?", "What would you change about the world if you could?",
    "I am feeling unmotivated today. Can you cheer me up?", "Describe the place where you live.",
    "What is your favourite memory?", "Can you recommend a good way to spend a rainy afternoon?",
    "What do you fear the most, and why?", "Give me three tips for {goal}.",
]
GOALS = [
    "sleeping better", "learning a new language", "saving for a holiday", "running a first 10 km race",
    "keeping a tidy desk", "making friends in a new city", "cooking healthy meals on a budget", "preparing for a job interview",
    "reading more books", "reducing screen time", "writing a novel", "getting started with gardening", "public speaking",
]
SCIENCE = [
    "why the sky is blue", "how vaccines train the immune system", "how a refrigerator moves heat", "what causes the seasons",
    "how batteries store energy", "why ice floats", "how GPS finds a position", "what a black hole is",
    "how airplanes stay in the air", "how the heart pumps blood", "why bread rises", "how tides work",
    "what DNA does in a cell", "how a rainbow forms", "how noise-cancelling headphones work", "why metals conduct electricity",
    "how plants know which way is up", "how an MRI scanner works", "what makes a material a superconductor",
    "how earthquakes are measured", "how the internet routes a message", "why leaves change colour in autumn",
    "how the kidneys filter blood", "what entropy means", "how a compiler turns code into machine instructions",
    "how solar cells make electricity", "how antibiotics kill bacteria and why resistance appears",
    "what inflation is and how central banks respond to it", "how a neural network learns", "how sound travels",
]
HUMANITIES = [
    "the printing press and the spread of ideas", "the role of the Silk Road in exchanging technologies",
    "the causes of the First World War", "the rise and fall of the Aztec empire", "the Harlem Renaissance",
    "the impact of the steam engine on cities", "the history of democracy in ancient Athens",
    "the abolitionist movement", "the role of monasteries in medieval Europe", "the Meiji era in Japan",
    "the invention of writing in Mesopotamia", "the Bauhaus school of design", "the philosophy of Stoicism",
    "the ethics of lying", "the idea of the social contract", "impressionist painting", "the history of jazz",
    "the influence of Greek tragedy on modern theatre", "free will and responsibility", "the idea of progress",
    "how languages change over time", "the role of museums in society", "the economics of minimum wages",
    "colonialism and its lasting effects", "the history of the Olympic Games", "the meaning of happiness in different cultures",
]
THINKERS = [
    "Socrates", "Confucius", "Hannah Arendt", "Adam Smith", "Mary Wollstonecraft", "Ibn Khaldun", "Immanuel Kant",
    "Simone Weil", "John Locke", "Laozi", "Karl Popper", "Jane Jacobs", "Frederick Douglass", "Michel de Montaigne",
]
FIRST_NAMES = [
    "Ana", "Ben", "Chloé", "Dmitri", "Elif", "Farah", "Gustavo", "Hana", "Ivan", "Jia", "Kwame", "Lucía", "Mateo",
    "Nadia", "Oskar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara", "Zoltan",
]
LAST_NAMES = [
    "Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Novak", "Silva", "Kowalski", "Mensah", "Fischer",
    "Rossi", "Nguyen", "Andersen", "Petrov", "García", "Kaur", "O'Brien", "Yilmaz", "Dubois", "Sato",
]
CITIES = [
    "Lisbon", "Nairobi", "Osaka", "Toronto", "Kraków", "Lima", "Melbourne", "Tunis", "Hanoi", "Bergen", "Austin",
    "Porto Alegre", "Edinburgh", "Seoul", "Marrakesh", "Vancouver", "Tbilisi", "Cape Town", "Bologna", "Jakarta",
]
ITEMS = [
    ("notebook", 3.5), ("coffee mug", 8.0), ("desk lamp", 24.0), ("backpack", 39.0), ("water bottle", 12.5),
    ("headset", 55.0), ("umbrella", 15.0), ("keyboard", 45.0), ("plant pot", 6.0), ("puzzle", 18.0),
    ("tea set", 32.0), ("bicycle light", 21.0), ("scarf", 26.0), ("phone case", 14.0), ("board game", 29.0),
]
LANGUAGES = ["Python", "JavaScript", "C++", "Java", "Go", "Rust", "TypeScript", "C#"]
CODE_TASKS = [
    "returns the k most frequent words in a text", "checks whether two strings are anagrams",
    "merges overlapping intervals", "rotates a matrix by 90 degrees", "finds the longest common prefix of a list of strings",
    "parses a date like 2024-03-17 and returns the weekday", "computes the running median of a stream of numbers",
    "detects a cycle in a linked list", "implements a least-recently-used cache", "validates a Sudoku board",
    "converts a Roman numeral to an integer", "finds all permutations of a string", "counts islands in a grid of 0s and 1s",
    "implements a stack with a constant-time minimum", "returns the shortest path in an unweighted graph",
    "splits a list into chunks of size n", "evaluates an arithmetic expression given as a string",
    "finds the longest substring without repeating characters", "compresses a string like aaabcc into a3b1c2",
    "checks whether brackets in a string are balanced", "returns the nth prime number", "groups words by their anagram",
    "computes the edit distance between two words", "finds two numbers in a list that add up to a target",
    "converts a number to its binary representation without built-ins", "reads a JSON file and prints its keys sorted",
    "simulates rolling two dice 10,000 times and prints the frequencies", "implements merge sort",
    "finds the majority element of a list", "builds a trie and checks whether words are in it",
]
CODE_REQUESTS = [
    "Explain what it does, step by step.", "Is there a bug? If so, explain it and give a corrected version.",
    "Write three unit tests for it.", "What is its time and space complexity?", "Rewrite it to be easier to read.",
    "Add type hints and a docstring.", "Translate it into {language}.", "Suggest two improvements and show the new code.",
    "Describe an input on which it would behave unexpectedly.", "Summarise it in one sentence, then explain the tricky part.",
]
EXTRACTION_REQUESTS = [
    "Summarise the text below in three sentences.", "List the key points of the following text as bullets.",
    "Extract every technical term from the text below and explain each in a few words.",
    "Rewrite the following passage for a beginner, keeping all the facts.",
    "Write five quiz questions (with answers) based on this text.",
    "What is the main purpose of what is described below? Answer in one paragraph, then list any parameters or options it mentions.",
    "Turn the following description into a JSON object with the fields name, purpose and options.",
    "Identify any limitations or warnings in the text below.",
]


# --- procedural material -------------------------------------------------------------------------

def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _date(rng: random.Random) -> str:
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
              "November", "December"]
    return f"{rng.randint(1, 28)} {rng.choice(months)}"


def _meeting_notes(rng: random.Random) -> str:
    people = rng.sample(FIRST_NAMES, 4)
    topics = rng.sample(SUBJECTS, 3)
    lines = [f"Meeting notes, {_date(rng)}. Present: {', '.join(people)}."]
    for t in topics:
        who, other = rng.sample(people, 2)
        lines.append(f"- {who} reported on {t}; {other} raised a concern about the budget of "
                     f"{rng.randint(2, 90) * 100} euros.")
        lines.append(f"- Action: {rng.choice(people)} will send a proposal on {t} by {_date(rng)}.")
    lines.append(f"- Next meeting: {_date(rng)} in room {rng.randint(100, 450)}.")
    return "\n".join(lines)


def _orders_table(rng: random.Random) -> str:
    rows = ["order_id,customer,city,item,quantity,unit_price"]
    for i in range(rng.randint(5, 9)):
        item, price = rng.choice(ITEMS)
        rows.append(f"{1000 + 7 * i + rng.randint(0, 6)},{_person(rng)},{rng.choice(CITIES)},{item},"
                    f"{rng.randint(1, 6)},{price:.2f}")
    return "\n".join(rows)


def _company_records(rng: random.Random) -> str:
    names = rng.sample(["Northwind", "Bluepeak", "Solara", "Ferrum", "Quillon", "Tidewater", "Orchid Labs", "Kestrel"], 4)
    out = []
    for n in names:
        rev = rng.randint(20, 900)
        out.append(f"{n}, based in {rng.choice(CITIES)} and led by {_person(rng)}, had revenue of {rev} million dollars "
                   f"and a profit of {rng.randint(-rev // 5, rev // 3)} million dollars last year, with "
                   f"{rng.randint(40, 9000)} employees.")
    return "\n".join(out)


def _reviews(rng: random.Random) -> str:
    good = ["the staff were lovely", "it arrived a day early", "the sound quality is excellent", "great value for money",
            "the view was breathtaking", "setup took two minutes"]
    bad = ["the battery died within a week", "we waited an hour for a table", "the instructions were confusing",
           "it was far too noisy at night", "the colour faded after one wash", "customer service never answered"]
    out = []
    for i in range(rng.randint(3, 5)):
        parts = rng.sample(good, rng.randint(0, 2)) + rng.sample(bad, rng.randint(0, 2)) or [rng.choice(good)]
        rng.shuffle(parts)
        out.append(f"{i + 1}. " + "; ".join(parts).capitalize() + ".")
    return "\n".join(out)


def _news_item(rng: random.Random) -> str:
    a, b = _person(rng), _person(rng)
    city, other = rng.sample(CITIES, 2)
    org = rng.choice(["the University of " + city, city + " City Council", "the Red Cross", "a local start-up",
                      "the national weather service", "the regional hospital"])
    return (f"On {_date(rng)}, {a} of {org} announced in {city} a plan to work on {rng.choice(SUBJECTS)}. "
            f"{b}, who travelled from {other} for the event, said the project would start within "
            f"{rng.randint(2, 18)} months and employ about {rng.randint(5, 300)} people.")


def _schedule(rng: random.Random) -> str:
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
    return "\n".join(f"{d}: {rng.choice(FIRST_NAMES)} has {rng.choice(['a dentist appointment', 'football practice', 'a work trip', 'piano lessons', 'a late shift', 'nothing planned'])} "
                     f"from {rng.randint(8, 17)}:00 to {rng.randint(18, 21)}:00" for d in days)


DATA_MATERIAL: list[tuple[Callable[[random.Random], str], list[str]]] = [
    (_meeting_notes, ["List every action item with its owner and deadline, as JSON.",
                      "Write a short email to the team summarising these notes.",
                      "Which topics need a decision at the next meeting? Explain briefly."]),
    (_orders_table, ["Compute the total value of each order and the grand total. Show your work.",
                     "Which city ordered the most items? Return the answer as a CSV line per city.",
                     "Convert this table into a JSON list of objects."]),
    (_company_records, ["Which company had the highest profit margin? Name its leader.",
                        "Rank the companies by revenue per employee and explain the ranking.",
                        "Return a table with the company, its city and its profit."]),
    (_reviews, ["Rate each review from 1 (very negative) to 5 (very positive) and give the ratings as a list.",
                "Summarise what customers liked and disliked.",
                "For each review, name the main complaint, if any."]),
    (_news_item, ["Identify the people, places and organisations mentioned, grouped by type, as JSON.",
                  "Write a headline and a one-sentence summary for this news item.",
                  "What questions would a journalist ask next? List four."]),
    (_schedule, ["Who is free on Wednesday evening? When could the whole family have dinner together?",
                 "Turn this schedule into a table.", "Count the days on which someone has a commitment after 18:00."]),
]


@cache
def stdlib_passages() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(docstrings, function sources) of 200-1200 / 5-25-line pieces of Python's standard library,
    in a fixed order for a given Python version (see the module docstring)."""
    modules = ["json", "csv", "collections", "itertools", "functools", "string", "textwrap", "datetime", "statistics",
               "random", "heapq", "bisect", "shutil", "pathlib", "urllib.parse", "argparse", "logging", "calendar",
               "decimal", "fractions", "zipfile", "difflib", "html", "enum", "dataclasses", "contextlib", "copy",
               "pprint", "fnmatch", "glob", "tempfile", "filecmp", "colorsys", "shlex", "configparser", "mimetypes",
               "ipaddress", "graphlib", "secrets", "uuid", "gzip", "wave", "quopri", "netrc", "sched", "timeit",
               "traceback", "warnings", "operator", "numbers", "abc", "queue", "email.utils", "http.cookies"]
    docs, codes = [], []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            doc = inspect.getdoc(obj) or ""
            if 200 <= len(doc) <= 1200:
                docs.append(f"{name}.{attr}:\n{doc}")
            if inspect.isfunction(obj):
                try:
                    src = textwrap.dedent(inspect.getsource(obj))
                except (OSError, TypeError):
                    continue
                if 5 <= src.count("\n") <= 25:
                    codes.append(src.rstrip())
    return tuple(docs), tuple(codes)


# --- one generator per category --------------------------------------------------------------------
#
# Each generator fills all of its frames, then picks one: every call draws the same random numbers
# in the same order, and those draws are part of the prompt list that existing shards record
# (``prompts.jsonl``). Filling only the chosen frame would change every later prompt.

def _writing(rng: random.Random) -> str:
    form, subject = rng.choice(FORMS), rng.choice(SUBJECTS)
    extras = " ".join(rng.sample(CONSTRAINTS, rng.randint(1, 2)) + rng.sample(FORMATS, rng.randint(0, 1)))
    frames = [
        f"Write a {rng.choice(LENGTHS)} {form} about {subject} for {rng.choice(AUDIENCES)}. {extras}",
        f"Help me draft a {form} about {subject}. {extras}",
        f"I need a {rng.choice(LENGTHS)} {form} on {subject}. Propose {rng.randint(2, 5)} possible titles first, "
        f"then write it under the best one. {extras}",
        f"Create an outline for a {form} about {subject}, with sections and key points for each, then write "
        f"the opening paragraph. {extras}",
        f"Here is my draft {form}: \"{rng.choice(SUBJECTS).capitalize()} changed my life. It was good and I liked it "
        f"a lot because it was very nice.\" Rewrite it so it is more vivid and specific. {extras}",
    ]
    return rng.choice(frames)


def _roleplay(rng: random.Random) -> str:
    opener = rng.choice(PERSONA_OPENERS).format(persona=rng.choice(PERSONAS))
    question = rng.choice(PERSONA_QUESTIONS).format(subject=rng.choice(SUBJECTS), science=rng.choice(SCIENCE),
                                                    goal=rng.choice(GOALS))
    return f"{opener} {rng.choice(['First question:', 'Let us begin.', 'Here is my question:', ''])} {question}".replace("  ", " ")


def _reasoning(rng: random.Random) -> str:
    names = rng.sample(FIRST_NAMES, 4)
    n, m = rng.randint(12, 40), rng.randint(2, 9)
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    frames = [
        f"{names[0]} is older than {names[1]}. {names[2]} is younger than {names[1]} but older than {names[3]}. "
        f"Who is the youngest, and who is the oldest? Explain your reasoning.",
        f"If today is {rng.choice(days)}, what day of the week will it be in {rng.randint(20, 400)} days? Show how you worked it out.",
        f"A shepherd has {n} sheep. All but {m} run away. How many are left? Explain why the question can be misleading.",
        f"{names[0]} has {m} brothers, and each brother has {rng.randint(1, 4)} sisters. What is the smallest possible "
        f"number of children in the family? Reason step by step.",
        f"I must choose between {rng.choice(SUBJECTS)} and {rng.choice(SUBJECTS)} as a project for {rng.choice(AUDIENCES)}. "
        f"List the criteria you would use, weigh both options, and recommend one.",
        f"In a race, {names[0]} overtakes the runner in position {m + 1}. In which position is {names[0]} now? "
        f"And where is the runner who was overtaken?",
        f"Three boxes are labelled 'apples', 'oranges' and 'mixed', and every label is wrong. You may take one fruit "
        f"from one box. Which box do you pick from, and how do you then relabel all three? {rng.choice(FORMATS)}",
        f"A statement reads: 'Everyone who likes {rng.choice(SUBJECTS)} also likes puzzles, and {names[0]} likes "
        f"puzzles.' Can we conclude that {names[0]} likes it? Explain the logical error, if any.",
    ]
    return rng.choice(frames)


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 19), rng.randint(2, 30), rng.randint(3, 60)
    p, q = rng.randint(10, 70), rng.randint(5, 40)
    item, price = rng.choice(ITEMS)
    name = rng.choice(FIRST_NAMES)
    frames = [
        f"{name} buys {a} of the {item}s at ${price:.2f} each and {b} more at a {q}% discount. What is the total cost?",
        f"In a survey, {p}% of people like tea, {min(95, p + q)}% like coffee, and {q}% like both. What share likes "
        f"neither? Explain using a Venn diagram in words.",
        f"Solve the system of equations: {a}x + {b}y = {c}, x - y = {a - 1}. Show each step.",
        f"Find the roots of x^2 - {a + b}x + {a * b} = 0 and check them.",
        f"The vertices of a triangle are (0, 0), ({a}, 0) and ({b}, {c}). What is its area?",
        f"If f(x) = {a}x^2 - {b}x + {c}, what is f({rng.randint(2, 9)})? What is the minimum of f?",
        f"I roll two fair dice. What is the probability that the sum is at least {rng.randint(6, 11)}? Show the counting.",
        f"A savings account pays {rng.randint(2, 7)}% interest per year, compounded yearly. How much does ${c * 100} "
        f"grow to after {rng.randint(2, 10)} years?",
        f"A tank fills in {a} hours with one pipe and in {b} hours with another. How long with both pipes open?",
        f"What is the sum of the first {c} terms of the arithmetic sequence {a}, {a + b}, {a + 2 * b}, ...?",
        f"How many ways can {rng.randint(4, 8)} people sit in a row if two of them insist on sitting together?",
        f"Prove that the sum of two odd numbers is even, then give a numeric example with {2 * a + 1} and {2 * b + 1}.",
    ]
    return rng.choice(frames)


def _coding(rng: random.Random) -> str:
    lang = rng.choice(LANGUAGES)
    request = rng.choice(CODE_REQUESTS).format(language=rng.choice([x for x in LANGUAGES if x != "Python"]))
    _, codes = stdlib_passages()
    frames = [
        f"Write a {lang} function that {rng.choice(CODE_TASKS)}. {rng.choice(['Include comments.', 'Explain its complexity.', 'Add a few example calls.', 'Handle invalid input.', ''])}",
        f"How would you design a program that {rng.choice(CODE_TASKS)}? Describe the approach, then implement it in {lang}.",
        f"Here is a Python function:\n\n```python\n{rng.choice(codes)}\n```\n\n{request}" if codes else
        f"Write a {lang} class that {rng.choice(CODE_TASKS)}.",
        f"Write a SQL query over a table orders(id, customer, city, total, created_at) that returns "
        f"{rng.choice(['the top 5 customers by total spending', 'the monthly revenue per city', 'customers with more than 3 orders', 'the average order value per weekday'])}. Explain it.",
    ]
    return rng.choice(frames)


def _extraction(rng: random.Random) -> str:
    docs, _ = stdlib_passages()
    if docs and rng.random() < 0.4:
        return f"{rng.choice(EXTRACTION_REQUESTS)}\n\n{rng.choice(docs)}"
    make, requests = rng.choice(DATA_MATERIAL)
    return f"{rng.choice(requests)}\n\n{make(rng)}"


def _stem(rng: random.Random) -> str:
    s, t = rng.sample(SCIENCE, 2)
    frames = [
        f"Explain {s}. {rng.choice(['Then give a real-world example.', 'Include the key terms and define them.', 'Use an analogy.', 'Add a short experiment someone could try at home.'])}",
        f"Could you describe {s}, and then compare it with {t}? {rng.choice(FORMATS)}",
        f"A student asks me {s}. Give an answer suited to {rng.choice(AUDIENCES)}, then a more advanced one.",
        f"What are common misconceptions about {s}? Correct each one.",
        f"Outline, step by step, {s}, and state which assumptions your explanation makes.",
    ]
    return rng.choice(frames)


def _humanities(rng: random.Random) -> str:
    h, thinker = rng.choice(HUMANITIES), rng.choice(THINKERS)
    frames = [
        f"Discuss {h}. Give two concrete examples and one counterargument.",
        f"What would {thinker} think about {rng.choice(SUBJECTS)}? Answer in their spirit, then comment on the answer.",
        f"Write a short essay plan on {h}: a thesis, three arguments, and a conclusion.",
        f"How did {h} shape the world we live in today? {rng.choice(FORMATS)}",
        f"Design a lesson for {rng.choice(AUDIENCES)} about {h}, with an activity and three discussion questions.",
        f"Compare the views of {thinker} and {rng.choice(THINKERS)} on {rng.choice(['justice', 'education', 'freedom', 'work', 'friendship', 'the good life'])}.",
    ]
    return rng.choice(frames)


GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "coding": _coding, "extraction": _extraction, "humanities": _humanities, "math": _math,
    "reasoning": _reasoning, "roleplay": _roleplay, "stem": _stem, "writing": _writing,
}
