"""The ``open`` prompt source: chat requests spread over a wide bank of everyday topics.

``templates`` and ``composed`` draw their subjects from a few dozen topics each, so across
thousands of prompts the target keeps answering about the same things: the draft's held-out
acceptance on those sources rises much faster than on MT-Bench (docs/history/training.md, "The
fifth run"). This source asks the same kinds of requests (the eight categories, with the audiences,
forms, constraints and formats of ``composed``) about ``TOPICS``: over four hundred topics of our
own wording in twenty-five domains, from household chores to law, so that what the target writes,
and what the draft learns to predict, covers far more of the language users bring.

Nothing here is drawn from MT-Bench; the pipeline's 8-gram check runs on these prompts too.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from flm_train.composed_prompts import (AUDIENCES, CITIES, CONSTRAINTS, FIRST_NAMES, FORMATS, FORMS, LANGUAGES,
                                        LENGTHS, PERSONAS, THINKERS)

# --- the topic bank (our own): domain -> topics, each a noun phrase that reads after "about" ---------

DOMAINS: dict[str, list[str]] = {
    "home": ["cleaning a kitchen oven", "fixing a dripping tap", "choosing a mattress", "decluttering a wardrobe",
             "painting a bedroom", "insulating an old house", "getting rid of mould in a bathroom", "buying a used sofa",
             "organising a garage", "keeping a home cool without air conditioning", "sharing a flat with strangers",
             "hanging shelves on a plaster wall", "lowering the electricity bill", "childproofing a living room",
             "moving house with two cats", "choosing curtains for a small room", "storing winter clothes"],
    "food": ["fermenting vegetables at home", "the chemistry of caramel", "cooking rice perfectly", "street food in Bangkok",
             "the history of pizza", "knife skills for beginners", "meal planning for a week", "plant-based protein",
             "the difference between baking soda and baking powder", "making fresh pasta", "spices of Indian cooking",
             "food waste in restaurants", "the rise of oat milk", "brewing tea properly", "chocolate making",
             "olive oil tasting", "school lunches", "cooking for a large family gathering", "the Mediterranean diet"],
    "health": ["the benefits of walking every day", "seasonal allergies", "how to read a nutrition label", "back pain at a desk job",
               "staying hydrated in hot weather", "the common cold", "managing stress before exams", "first aid for burns",
               "the importance of vitamin D", "screen time and eyesight", "healthy snacks for children", "stretching after exercise",
               "the role of gut bacteria", "learning to meditate", "quitting sugar", "caring for an elderly parent",
               "how hearing loss happens", "dental care habits"],
    "work": ["asking for a raise", "running an effective meeting", "writing a good resume", "working from a café",
             "dealing with a difficult coworker", "the four-day work week", "onboarding new staff", "giving feedback kindly",
             "switching careers at forty", "negotiating a job offer", "burnout in the workplace", "freelancing as a designer",
             "writing clear emails", "managing a remote team", "workplace diversity", "preparing a quarterly report",
             "job interviews over video", "mentoring a junior colleague"],
    "money": ["building an emergency fund", "how credit scores work", "index funds", "paying off student loans",
              "the cost of owning a car", "renting versus buying a home", "saving for retirement in your twenties",
              "splitting bills with a partner", "inflation and savings accounts", "budgeting apps", "buying insurance",
              "the basics of taxes for freelancers", "cryptocurrency risks", "teaching children about money",
              "haggling at a market", "subscription services that add up", "microloans in developing countries"],
    "business": ["opening a small café", "customer loyalty programmes", "supply chain delays", "pricing a new product",
                 "writing a business plan", "the success of family-owned companies", "online marketplaces",
                 "franchises", "crowdfunding a board game", "brand storytelling", "market research on a budget",
                 "managing inventory in a shop", "the gig economy", "corporate social responsibility",
                 "mergers between rival companies", "a start-up's first hire", "selling handmade jewellery online"],
    "technology": ["password managers", "how search engines rank pages", "smart home devices", "cloud storage",
                   "the history of the mouse and keyboard", "open-source licences", "virtual reality headsets",
                   "backing up family photos", "5G networks", "electric car charging stations", "quantum computers",
                   "self-driving delivery robots", "spam filters", "the first personal computers", "e-readers",
                   "wearable fitness trackers", "digital accessibility for blind users", "recommendation algorithms"],
    "software": ["version control with git", "writing readable code", "code reviews", "unit testing", "technical debt",
                 "relational databases", "REST APIs", "containers and virtual machines", "debugging a slow program",
                 "learning regular expressions", "pair programming", "documentation for open-source projects",
                 "choosing a web framework", "memory leaks", "continuous integration", "accessibility in web design",
                 "the command line for beginners", "caching"],
    "science": ["photosynthesis in desert plants", "the life cycle of stars", "how vaccines are tested", "the water table",
                "why cats purr", "the chemistry of soap", "antibiotic resistance", "the speed of sound", "plate tectonics",
                "the discovery of penicillin", "how bats navigate", "carbon dating", "the human microbiome",
                "superconductors", "the physics of a bicycle", "how clouds form", "crystals", "the periodic table",
                "the immune response to a cut", "genetic inheritance of eye colour"],
    "nature": ["migratory birds", "mushrooms in the forest", "the Amazon rainforest", "wolves returning to Europe",
               "coral bleaching", "pollinators in cities", "the tundra", "wetlands", "the life of an octopus",
               "invasive species", "old-growth forests", "desert animals that never drink", "whale songs",
               "the seasons in a deciduous forest", "river restoration", "ant colonies", "night-time animals",
               "the Galápagos Islands"],
    "environment": ["plastic in the oceans", "carbon footprints of air travel", "rewilding farmland", "heat waves in cities",
                    "electric buses", "repairing instead of replacing", "fast fashion", "community composting",
                    "rainwater harvesting", "light pollution", "sustainable fishing", "green roofs", "the circular economy",
                    "melting glaciers", "noise pollution", "deposit schemes for bottles", "tree planting campaigns"],
    "history": ["the Hanseatic League", "life in a medieval village", "the Ottoman Empire", "the invention of paper",
                "the Apollo programme", "ancient Egyptian medicine", "the Viking age", "the building of railways",
                "the history of coffeehouses", "the Inca road system", "women in the Second World War",
                "the Great Depression", "the fall of the Berlin Wall", "the history of vaccination",
                "the Mongol Empire", "the spice trade", "the history of public schools", "the printing of newspapers"],
    "culture": ["the history of hip hop", "why people love horror films", "folk tales from around the world",
                "the tradition of afternoon tea", "wedding customs in different countries", "the popularity of anime",
                "tattoos in history", "the role of festivals in small towns", "the art of calligraphy",
                "modern dance", "the influence of television on language", "graffiti as art", "the history of board games",
                "museum etiquette", "comic books", "the revival of vinyl records", "opera for newcomers"],
    "arts": ["watercolour painting", "writing haiku", "the golden ratio in design", "learning the guitar", "photography lighting",
             "sculpture in public spaces", "the life of Frida Kahlo", "pottery", "the Baroque period in music",
             "how to critique a painting", "typography", "the history of animation", "screenwriting", "choir singing",
             "the art of the short story", "street photography", "knitting patterns"],
    "education": ["homework in primary school", "learning multiplication tables", "online courses", "studying abroad",
                  "the value of a liberal arts degree", "school uniforms", "teaching critical thinking",
                  "gap years", "learning through play", "bilingual schools", "exam anxiety", "note-taking methods",
                  "school libraries", "vocational training", "adult education", "class sizes", "grading on a curve"],
    "travel": ["packing light for a long trip", "travelling by train across Europe", "jet lag", "visiting Kyoto",
               "budget backpacking in South America", "travel insurance", "road trips with children",
               "ecotourism in Costa Rica", "overtourism in Venice", "learning phrases before a trip", "solo travel",
               "camping in the desert", "airport security", "cruise ships", "house swapping", "visiting Marrakesh",
               "hiking the Camino de Santiago"],
    "sports": ["the rules of cricket", "training for a triathlon", "women's football", "the history of the marathon",
               "rock climbing indoors", "team spirit in amateur leagues", "sports injuries in teenagers",
               "the economics of the football transfer market", "yoga for runners", "the Tour de France",
               "chess as a sport", "swimming technique", "esports", "coaching a youth basketball team",
               "the Paralympic Games", "skiing safety", "table tennis"],
    "society": ["loneliness in big cities", "volunteering", "the four generations in one workplace",
                "public transport fares", "housing for young people", "the role of libraries today",
                "neighbourhood watch groups", "civic participation", "ageing populations", "social media and friendship",
                "the digital divide", "community gardens", "local journalism", "immigration and language learning",
                "accessibility in public buildings", "the role of charities", "misinformation online"],
    "law": ["how small claims courts work", "tenant rights", "copyright for photographers", "jury duty",
            "consumer returns and refunds", "privacy laws for websites", "the presumption of innocence",
            "writing a will", "contracts for freelancers", "the history of the Magna Carta", "traffic fines",
            "trademarks for small brands", "human rights treaties", "data protection at work", "patents on medicines"],
    "politics": ["how elections are counted", "the separation of powers", "local government budgets", "voting age",
                 "the role of the United Nations", "referendums", "lobbying", "trade agreements",
                 "city planning decisions", "public debt", "the European Union's institutions", "political polling",
                 "free speech on campus", "term limits", "the welfare state"],
    "psychology": ["habits and how they form", "procrastination", "the placebo effect", "first impressions",
                   "memory and sleep", "motivation at work", "cognitive biases in shopping", "how children learn language",
                   "the psychology of colour", "resilience after failure", "introverts and extroverts", "decision fatigue",
                   "gratitude journals", "peer pressure", "the fear of public speaking", "daydreaming"],
    "parenting": ["bedtime routines for toddlers", "screen time for children", "teaching kids to ride a bike",
                  "sibling rivalry", "pocket money", "choosing a first pet for a child", "talking to teenagers",
                  "picky eaters", "school choice", "raising bilingual children", "children's birthday parties",
                  "chores for children", "reading aloud to children"],
    "hobbies": ["birdwatching", "keeping an aquarium", "model railways", "amateur astronomy", "stamp collecting",
                "geocaching", "home brewing", "woodworking", "bonsai trees", "learning magic tricks", "baking bread",
                "building a gaming PC", "urban sketching", "crossword puzzles", "beekeeping", "fishing",
                "restoring old furniture"],
    "transport": ["high-speed rail", "cycling lanes", "electric scooters", "air traffic control", "container ships",
                  "the history of the bicycle", "car sharing", "night buses", "the London Underground",
                  "hydrogen trucks", "traffic jams", "driving lessons", "canal boats", "ferries between islands"],
    "space": ["the International Space Station", "life on Mars", "exoplanets", "the James Webb Space Telescope",
              "space debris", "the phases of the Moon", "comets", "becoming an astronaut", "satellites and weather forecasts",
              "the Big Bang", "solar flares", "the rings of Saturn", "private space companies", "the northern lights"],
}
TOPICS: list[str] = [t for topics in DOMAINS.values() for t in topics]

EVENTS = ["a power cut", "a surprise visit from relatives", "a missed train", "a lost wallet", "heavy snow",
          "a broken laptop the day before a deadline", "a flooded basement", "a cancelled flight", "a noisy neighbour",
          "winning a small prize", "a job offer in another city", "a friend's wedding abroad"]
ROLES = ["a nurse", "a bus driver", "a software engineer", "a school principal", "a farmer", "a museum curator",
         "a pharmacist", "a city mayor", "a librarian", "a sports coach", "a journalist", "an architect", "a chef",
         "a marine biologist", "a lawyer", "a shop owner", "a pilot", "a social worker"]
DATA_TASKS = ["reads a CSV of {thing} and prints the three largest entries", "stores {thing} in a dictionary and "
              "lets the user search them by name", "validates a list of {thing} records and reports the invalid ones",
              "groups {thing} by category and counts each group", "sorts {thing} by date and removes duplicates",
              "simulates a simple queue of {thing} and reports the average waiting time",
              "exports {thing} to JSON and reads them back", "computes weekly totals from a log of {thing}"]
THINGS = ["library loans", "bike rentals", "patient appointments", "recipe ingredients", "train departures",
          "football match results", "warehouse parcels", "hotel bookings", "student grades", "sensor readings",
          "concert tickets", "grocery orders", "museum visitors", "tree inventory records", "job applications"]


def _topic(rng: random.Random) -> str:
    return rng.choice(TOPICS)


def _extras(rng: random.Random) -> str:
    return " ".join(rng.sample(CONSTRAINTS, rng.randint(0, 2)) + rng.sample(FORMATS, rng.randint(0, 1)))


# --- one generator per category --------------------------------------------------------------------
#
# As in ``composed_prompts``: each generator fills all of its frames, then picks one, so every call
# draws the same random numbers in the same order (the prompt list is prefix-stable).

def _writing(rng: random.Random) -> str:
    t, form, extras = _topic(rng), rng.choice(FORMS), _extras(rng)
    frames = [
        f"Write a {rng.choice(LENGTHS)} {form} about {t} for {rng.choice(AUDIENCES)}. {extras}",
        f"Can you write something about {t}? A {form} would be ideal. {extras}",
        f"I am {rng.choice(ROLES)} and I need a {form} about {t}. Make it engaging. {extras}",
        f"Write a story in which {rng.choice(FIRST_NAMES)}, {rng.choice(ROLES)}, has to deal with {rng.choice(EVENTS)}, "
        f"and learns something about {t} along the way. {extras}",
        f"Give me five ideas for a {form} about {t}, each with a one-line pitch. {extras}",
        f"Write a letter to a friend telling them why you have become interested in {t}. {extras}",
    ]
    return rng.choice(frames)


def _roleplay(rng: random.Random) -> str:
    t, role, persona = _topic(rng), rng.choice(ROLES), rng.choice(PERSONAS)
    frames = [
        f"Pretend you are {role} who is passionate about {t}. I am a curious visitor. Tell me what I should know.",
        f"Let's do a role-play. You are {persona}, and I come to you for advice about {t}. Start the conversation.",
        f"Act as an interviewer hiring {role}. Ask me your first three questions, one of them about {t}.",
        f"Imagine you are {persona} writing a diary entry on a day that had to do with {t}.",
        f"You are {role}. A friend at dinner asks you about {t}. Answer in your own voice, casually.",
        f"Play a debate: you argue for and I will argue against spending more public money on {t}. Make your opening statement.",
    ]
    return rng.choice(frames)


def _reasoning(rng: random.Random) -> str:
    t, u = rng.sample(TOPICS, 2)
    a, b = rng.sample(FIRST_NAMES, 2)
    n = rng.randint(3, 9)
    frames = [
        f"What are the strongest arguments for and against {t}? Weigh them and give your conclusion.",
        f"{a} says that {t} matters more than {u}. {b} disagrees. Who has the better case? Explain step by step.",
        f"What could go wrong with {t}, and how would you prevent each problem? Think it through carefully.",
        f"A town of {n * 1000} people has money for only one project: {t} or {u}. How should it decide?",
        f"Is there a hidden assumption in this claim: 'Everyone who cares about {t} should also care about {u}'? Explain.",
        f"{a} has {n} tasks to finish today, one of them about {t}, and only {n - 1} hours. How should {a} prioritise? Reason it out.",
        f"Explain the chain of causes and effects that links {t} to everyday life.",
    ]
    return rng.choice(frames)


def _math(rng: random.Random) -> str:
    t, name, city = _topic(rng), rng.choice(FIRST_NAMES), rng.choice(CITIES)
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(10, 95)
    frames = [
        f"{name} runs a club about {t} with {a} members. Each member pays {b} dollars a month and the room costs "
        f"{a * b // 2 + c} dollars a month. What is the monthly balance, and how many members are needed to break even?",
        f"A survey in {city} asked {a * 10} people about {t}; {c}% were in favour. How many people is that? "
        f"If {b} more people answered in favour, what would the new percentage be?",
        f"A project on {t} took {a} days with {b} people. How long would it take {b + 2} people working at the same "
        f"rate? State your assumption.",
        f"The number of visitors to an exhibition on {t} grew by {c % 30 + 5}% each year, starting at {a * 100}. "
        f"How many visitors were there after {b % 5 + 2} years?",
        f"{name} spends {b} hours a week on {t}. What fraction of the week is that, and how many hours a year?",
        f"A box of materials for {t} weighs {a}.{b} kg. How many boxes fit within a limit of {c * 10} kg, and what weight is left over?",
    ]
    return rng.choice(frames)


def _coding(rng: random.Random) -> str:
    thing, lang = rng.choice(THINGS), rng.choice(LANGUAGES)
    task = rng.choice(DATA_TASKS).format(thing=thing)
    frames = [
        f"Write a {lang} program that {task}.",
        f"I keep {thing} in a spreadsheet. Write a Python script that {task}, and explain how to run it.",
        f"Design the data model for an app that tracks {thing}, then write the {lang} code for the main class.",
        f"Write a function in {lang} that {task}. Include tests.",
        f"What data structure would you use for {thing} if you need fast lookups by date? Show an example in {lang}.",
    ]
    return rng.choice(frames)


def _extraction(rng: random.Random) -> str:
    t, u = rng.sample(TOPICS, 2)
    a, b = rng.sample(FIRST_NAMES, 2)
    city, other = rng.sample(CITIES, 2)
    n, m = rng.randint(12, 400), rng.randint(2, 30)
    text = (f"{a}, {rng.choice(ROLES)} from {city}, has spent {m} years working on {t}. Last spring {a} met {b}, "
            f"{rng.choice(ROLES)} in {other}, and together they started a project on {u} that now involves {n} "
            f"volunteers. Their first report, published in {rng.choice(['March', 'June', 'October'])}, asks for "
            f"{m * 1000} euros of funding and warns that {rng.choice(EVENTS)} nearly stopped the work.")
    requests = ["Extract the people, places, numbers and dates from this text, as JSON.",
                "Summarise the following text in one sentence, then list its key facts.",
                "Write three questions that this text answers, with their answers.",
                "What is the main problem described below, and who is affected?"]
    return f"{rng.choice(requests)}\n\n{text}"


def _stem(rng: random.Random) -> str:
    t = rng.choice(DOMAINS["science"] + DOMAINS["space"] + DOMAINS["technology"] + DOMAINS["nature"]
                   + DOMAINS["health"])
    frames = [
        f"How does {t} work? Explain the science behind it. {rng.choice(FORMATS)}",
        f"Explain {t} to {rng.choice(AUDIENCES)}, then list three questions scientists are still asking about it.",
        f"What is the most common misunderstanding about {t}? Correct it.",
        f"Describe a simple experiment or observation that teaches something about {t}.",
        f"What has research in the last fifty years taught us about {t}?",
    ]
    return rng.choice(frames)


def _humanities(rng: random.Random) -> str:
    t = rng.choice(DOMAINS["history"] + DOMAINS["culture"] + DOMAINS["society"] + DOMAINS["politics"]
                   + DOMAINS["law"] + DOMAINS["arts"] + DOMAINS["education"])
    frames = [
        f"Give me an overview of {t}: its background, why it matters, and how views on it have changed.",
        f"What would {rng.choice(THINKERS)} have said about {t}? Discuss.",
        f"Write an essay outline on {t} with a thesis and three supporting points.",
        f"How do different countries approach {t}? Compare two of them.",
        f"What are the ethical questions raised by {t}?",
    ]
    return rng.choice(frames)


GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "coding": _coding, "extraction": _extraction, "humanities": _humanities, "math": _math,
    "reasoning": _reasoning, "roleplay": _roleplay, "stem": _stem, "writing": _writing,
}
