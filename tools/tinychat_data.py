"""Synthetic conversations for training (and evaluating) the embedded tiny model.

Each sample is a chat (system, history, user turn, maybe tool results) plus the
completion the model should generate, in the embedded chat template's format:

* plain turns: a short grammatical English answer;
* tool turns: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` naming an
  *offered* tool (names, descriptions and parameter names vary per sample, so the
  model has to read the tool list), sometimes two calls;
* after tool results: an answer that uses them;
* with thinking on: a short reasoning segment, ``</think>``, then the answer.

``split="train"`` and ``split="eval"`` draw tool names from disjoint pools, so the
evaluation measures reading the tools, not memorising names. Deterministic for a
given ``random.Random``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CITIES = [
    "Paris",
    "London",
    "Tokyo",
    "Berlin",
    "Madrid",
    "Rome",
    "Oslo",
    "Lima",
    "Cairo",
    "Delhi",
    "Sydney",
    "Toronto",
    "Boston",
    "Denver",
    "Seattle",
    "Chicago",
    "Lisbon",
    "Vienna",
    "Prague",
    "Dublin",
    "Athens",
    "Nairobi",
    "Seoul",
    "Bangkok",
    "Hanoi",
    "Manila",
    "Quito",
    "Bogota",
    "Havana",
    "Warsaw",
    "Zurich",
    "Geneva",
    "Munich",
    "Milan",
    "Naples",
    "Porto",
    "Kyoto",
    "Osaka",
    "Austin",
    "Phoenix",
    "Miami",
    "Atlanta",
    "Dallas",
    "Houston",
    "Helsinki",
    "Riga",
]
ZONES = [
    "UTC",
    "Tokyo",
    "Paris",
    "New York",
    "London",
    "Sydney",
    "Berlin",
    "Europe/Paris",
    "America/Chicago",
    "Asia/Tokyo",
    "Los Angeles",
    "Cairo",
    "Delhi",
    "Lima",
    "Toronto",
]
DIRS = [
    "src",
    "docs",
    "tests",
    "/home/user",
    "/tmp",
    "./build",
    "src/utils",
    "app/models",
    "/var/log",
    "notes",
    "lib",
    "scripts",
    "data/raw",
    "config",
    "web/static",
    ".",
]
FILES = [
    "README.md",
    "notes.txt",
    "src/main.py",
    "setup.cfg",
    "app.js",
    "todo.txt",
    "Makefile",
    "config.yaml",
    "data.csv",
    "lib/util.py",
    "docs/intro.md",
    "index.html",
    "main.go",
    "server.py",
    "report.txt",
    "pyproject.toml",
    "tests/test_app.py",
    "style.css",
]
COMMANDS = [
    "ls -la",
    "git status",
    "make test",
    "pytest -q",
    "npm install",
    "cargo build",
    "python main.py",
    "git log --oneline",
    "df -h",
    "uname -a",
    "echo hello",
    "date",
    "go test ./...",
    "whoami",
    "pwd",
    "cat README.md",
    "npm test",
    "ruff check .",
]
TOPICS = [
    "trio nurseries",
    "rust lifetimes",
    "python decorators",
    "the moon landing",
    "solar panels",
    "bread baking",
    "chess openings",
    "jazz history",
    "sql joins",
    "http caching",
    "garden tomatoes",
    "black holes",
    "the roman empire",
    "git rebase",
    "unit testing",
    "electric cars",
    "sea turtles",
    "coffee brewing",
    "kv caches",
    "prime numbers",
]
PEOPLE = [
    "alice@example.com",
    "bob@example.com",
    "team@example.org",
    "carol@example.net",
    "dave@example.com",
    "ops@example.org",
]
MESSAGES = [
    "the build is green",
    "lunch is at noon",
    "the meeting moved to friday",
    "I pushed the fix",
    "please review my change",
    "the server is back up",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]
WORDS = ["apple", "river", "stone", "cloud", "garden", "music", "window", "paper", "light", "ocean"]


# Training draws most tool names, many parameter names and many argument values
# from these open-ended pools, fresh per sample, so the only way to get a call
# right is to copy from the prompt (the offered tools, the user's words).
NAME_VERBS = [
    "get",
    "fetch",
    "find",
    "show",
    "load",
    "make",
    "run",
    "do",
    "check",
    "query",
    "pull",
    "grab",
    "scan",
    "probe",
    "ask",
    "use",
    "take",
    "seek",
    "view",
    "send",
    "put",
    "call",
]
NAME_NOUNS = [
    "otter",
    "lamp",
    "river",
    "stone",
    "tiger",
    "maple",
    "piano",
    "rocket",
    "pebble",
    "falcon",
    "cactus",
    "harbor",
    "lantern",
    "walnut",
    "comet",
    "meadow",
    "copper",
    "violet",
    "ember",
    "quartz",
    "badger",
    "willow",
    "canyon",
    "garnet",
    "nimbus",
    "zephyr",
    "tundra",
    "orbit",
    "pixel",
    "widget",
    "gadget",
    "beacon",
    "anchor",
    "prism",
    "vertex",
    "kettle",
    "saddle",
    "cobalt",
    "amber",
    "helper",
    "tool",
    "info",
    "data",
    "item",
    "task",
    "job",
    "thing",
    "util",
    "agent",
    "node",
    "hub",
    "box",
    "kit",
    "bot",
    "box",
    "gate",
    "link",
]
PARAM_WORDS = [
    "input",
    "value",
    "target",
    "arg",
    "subject",
    "item",
    "key",
    "spec",
    "payload",
    "what",
    "where",
    "name",
    "source",
    "term",
    "entry",
    "param",
    "field",
    "object",
    "ref",
    "hint",
]
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ran",
    "to",
    "vel",
    "sor",
    "dan",
    "bri",
    "que",
    "mon",
    "tar",
    "lin",
    "pe",
    "zu",
    "ho",
    "ra",
    "ven",
    "gal",
    "nor",
    "bel",
    "cas",
    "dor",
    "fen",
    "mar",
    "sil",
]


def novel_name(rng: random.Random) -> str:
    verb, noun, other = rng.choice(NAME_VERBS), rng.choice(NAME_NOUNS), rng.choice(NAME_NOUNS)
    style = rng.randrange(8)
    if style == 0:
        return f"{verb}_{noun}"
    if style == 1:
        return f"{noun}_{other}"
    if style == 2:
        return verb + noun.capitalize()
    if style == 3:
        return noun.capitalize() + other.capitalize()
    if style == 4:
        return f"mcp__{noun}__{verb}_{other}"
    if style == 5:
        return noun
    if style == 6:
        return f"{noun}-{other}"
    return f"{verb}_{noun}_{rng.randint(1, 9)}"


def _place(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


NOVEL_VALUES: dict[str, Callable[[random.Random], list[str]]] = {
    "weather": lambda rng: [_place(rng)],
    "time": lambda rng: [_place(rng)],
    "list_files": lambda rng: [
        rng.choice(["src/", "lib/", "/home/", "./", ""]) + rng.choice(NAME_NOUNS)
    ],
    "read_file": lambda rng: [
        rng.choice(NAME_NOUNS) + rng.choice([".py", ".txt", ".md", ".json", ".go", ".rs", ".toml"])
    ],
    "run_command": lambda rng: [
        rng.choice(["make", "git", "npm run", "python", "cargo", "ls"])
        + " "
        + rng.choice(NAME_NOUNS)
    ],
    "search": lambda rng: [f"{rng.choice(NAME_NOUNS)} {rng.choice(NAME_NOUNS)}s"],
    "send_email": lambda rng: [
        f"{rng.choice(NAME_NOUNS)}@example.com",
        f"the {rng.choice(NAME_NOUNS)} is ready",
    ],
    "calculator": lambda rng: [_expr(rng)[0]],
    "write_file": lambda rng: [
        rng.choice(NAME_NOUNS) + rng.choice([".txt", ".md", ".py"]),
        rng.choice(NAME_NOUNS + WORDS),
    ],
}


def _expr(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a} {op} {b}", str(value)


@dataclass
class Family:
    """One kind of tool, with everything that may vary between samples."""

    key: str
    train_names: list[str]
    eval_names: list[str]
    descriptions: list[str]
    params: list[list[str]]  # per required parameter: the names it may have
    param_descriptions: list[str]
    requests: list[str]  # templates over {0}, {1} (the argument values)
    values: Callable[[random.Random], list[str]]
    result: Callable[[random.Random, list[str]], str]
    answer: Callable[[list[str], str], str]
    intent: str  # for reasoning: "The user wants <intent>."
    optional: list[tuple[str, str]] = field(default_factory=list)  # (name, description)


def _weather_result(rng: random.Random, v: list[str]) -> str:
    return json.dumps(
        {"city": v[0], "condition": rng.choice(CONDITIONS), "temperature": rng.randint(-5, 35)}
    )


def _weather_answer(v: list[str], result: str) -> str:
    data = json.loads(result)
    return f"It is {data['condition']} in {v[0]} with {data['temperature']} degrees."


FAMILIES = [
    Family(
        "weather",
        [
            "get_weather",
            "fetch_weather",
            "weather_lookup",
            "current_weather",
            "check_weather",
            "weather_now",
            "get_forecast",
            "WeatherTool",
        ],
        ["obtain_conditions", "meteo", "sky_report", "climate_query"],
        [
            "Get the current weather for a city.",
            "Look up today's weather in a place.",
            "Returns current weather conditions.",
            "Weather report for a location.",
        ],
        [["city", "location", "place", "town"]],
        ["The city name."],
        [
            "What's the weather in {0}?",
            "How is the weather in {0} today?",
            "Is it raining in {0} right now?",
            "Tell me the weather for {0}.",
            "weather in {0}?",
            "What is the weather like in {0}?",
            "Check the weather in {0}, please.",
        ],
        lambda rng: [rng.choice(CITIES)],
        _weather_result,
        _weather_answer,
        "the weather in {0}",
        [("units", "celsius or fahrenheit")],
    ),
    Family(
        "time",
        ["get_time", "current_time", "time_now", "clock", "get_local_time", "TimeLookup"],
        ["wall_clock", "what_time", "tz_clock"],
        [
            "Get the current local time in a time zone.",
            "Returns the current time for a place.",
            "Tells the time in a zone.",
        ],
        [["timezone", "zone", "tz", "location"]],
        ["A time zone or city."],
        [
            "What time is it in {0}?",
            "Tell me the current time in {0}.",
            "What's the local time in {0}?",
            "time in {0}?",
        ],
        lambda rng: [rng.choice(ZONES)],
        lambda rng, v: f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
        lambda v, r: f"It is {r} in {v[0]}.",
        "the time in {0}",
    ),
    Family(
        "list_files",
        ["list_files", "ls", "list_directory", "list_dir", "show_files", "ListFiles"],
        ["dir_contents", "enumerate_folder", "browse"],
        [
            "List the files in a directory.",
            "Show the entries of a folder.",
            "Returns the names of files in a directory.",
        ],
        [["path", "directory", "dir", "folder"]],
        ["The directory to list."],
        [
            "List the files in {0}.",
            "What files are in {0}?",
            "Show me the contents of the folder {0}.",
            "ls {0}",
            "Which files does {0} have?",
        ],
        lambda rng: [rng.choice(DIRS)],
        lambda rng, v: "\n".join(
            rng.sample(
                ["main.py", "util.py", "README.md", "notes.txt", "app.js", "data.csv", "Makefile"],
                3,
            )
        ),
        lambda v, r: (
            f"The folder {v[0]} contains {', '.join(r.splitlines()[:-1])} and {r.splitlines()[-1]}."
        ),
        "the files in {0}",
    ),
    Family(
        "read_file",
        ["read_file", "cat", "open_file", "get_file", "view_file", "ReadFile"],
        ["file_text", "load_document", "peek"],
        [
            "Read a file and return its text.",
            "Returns the contents of a file.",
            "Open a text file.",
        ],
        [["path", "file", "filename", "file_path"]],
        ["The file to read."],
        [
            "Read the file {0}.",
            "Show me what is in {0}.",
            "Open {0} and tell me what it says.",
            "What does {0} contain?",
            "cat {0}",
        ],
        lambda rng: [rng.choice(FILES)],
        lambda rng, v: rng.choice(
            [
                "print('hello')",
                "TODO: write tests",
                "name = demo",
                "hello world",
                "x = 1",
                "version 2",
            ]
        ),
        lambda v, r: f"The file {v[0]} says: {r}",
        "the contents of {0}",
    ),
    Family(
        "run_command",
        ["run_command", "shell", "exec", "bash", "run_shell", "execute", "Bash"],
        ["terminal", "sh_run", "invoke_cli"],
        [
            "Run a shell command and return its output.",
            "Execute a command in the terminal.",
            "Runs a command line.",
        ],
        [["command", "cmd", "script"]],
        ["The command line to run."],
        [
            "Run `{0}`.",
            "Execute the command {0}.",
            "Please run {0} in the shell.",
            "Can you run {0}?",
            "run {0}",
        ],
        lambda rng: [rng.choice(COMMANDS)],
        lambda rng, v: rng.choice(
            ["ok", "done", "3 files", "all tests passed", "On branch main", "exit code 0"]
        ),
        lambda v, r: f"I ran {v[0]} and it printed: {r}",
        "to run {0}",
    ),
    Family(
        "calculator",
        ["calculator", "calculate", "compute", "eval_math", "math", "Calc"],
        ["arith", "evaluate_expression", "number_cruncher"],
        [
            "Evaluate an arithmetic expression.",
            "A calculator for math expressions.",
            "Computes a math formula.",
        ],
        [["expression", "expr", "formula"]],
        ["The expression to evaluate."],
        ["What is {0}?", "Calculate {0}.", "Compute {0} for me.", "How much is {0}?", "{0} = ?"],
        lambda rng: [_expr(rng)[0]],
        lambda rng, v: str(eval(v[0])),  # noqa: S307 - our own generated arithmetic
        lambda v, r: f"{v[0]} is {r}.",
        "to compute {0}",
    ),
    Family(
        "search",
        ["search", "web_search", "search_web", "find_info", "lookup", "query_docs", "WebSearch"],
        ["discover", "research", "look_around"],
        [
            "Search the web and return the top results.",
            "Find information about a topic.",
            "Search documents for a query.",
        ],
        [["query", "q", "terms", "text"]],
        ["What to search for."],
        [
            "Search for {0}.",
            "Look up {0} online.",
            "Find information about {0}.",
            "Can you search {0}?",
            "I need facts on {0}.",
        ],
        lambda rng: [rng.choice(TOPICS)],
        lambda rng, v: f"{v[0].capitalize()} is a well known subject with many guides.",
        lambda v, r: f"Here is what I found: {r}",
        "information about {0}",
    ),
    Family(
        "send_email",
        ["send_email", "email", "send_message", "notify", "SendMail"],
        ["dispatch_note", "mail_out", "post_message"],
        ["Send an email to someone.", "Send a short message to a recipient.", "Email a person."],
        [["to", "recipient", "address"], ["body", "message", "text"]],
        ["Who receives it.", "What it says."],
        [
            "Send an email to {0} saying {1}.",
            "Tell {0} that {1}.",
            "Email {0}: {1}",
            "Message {0} that {1}.",
        ],
        lambda rng: [rng.choice(PEOPLE), rng.choice(MESSAGES)],
        lambda rng, v: "sent",
        lambda v, r: f"Done. I sent the message to {v[0]}.",
        "to send a message to {0}",
    ),
    Family(
        "write_file",
        ["write_file", "create_file", "save_file", "put_file", "Write"],
        ["store_text", "persist_file", "make_document"],
        ["Write text to a file.", "Create a file with some content.", "Save text into a file."],
        [["path", "file", "filename"], ["content", "text", "data"]],
        ["The file to write.", "The text to write."],
        [
            "Create a file {0} with the text {1}.",
            "Write {1} into {0}.",
            "Save {1} to {0}.",
            "Make a file called {0} that says {1}.",
        ],
        lambda rng: [rng.choice(FILES), rng.choice(WORDS + MESSAGES)],
        lambda rng, v: "ok",
        lambda v, r: f"I wrote the text to {v[0]}.",
        "to write to {0}",
    ),
]

# Plain turns: (request templates, answer templates), filled from WORDS/TOPICS/...
CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Germany": "Berlin",
    "Spain": "Madrid",
    "Italy": "Rome",
    "Norway": "Oslo",
    "Peru": "Lima",
    "Egypt": "Cairo",
    "Ireland": "Dublin",
    "Greece": "Athens",
    "Austria": "Vienna",
    "Portugal": "Lisbon",
    "Kenya": "Nairobi",
    "Poland": "Warsaw",
}
COLORS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a tomato": "red",
    "the sea": "blue",
    "an orange": "orange",
    "milk": "white",
    "a lemon": "yellow",
}


def _plain(rng: random.Random) -> tuple[str, str, str]:
    """(user text, answer, what the user wants) for a turn that needs no tool."""
    kind = rng.randrange(10)
    if kind == 0:
        greeting = rng.choice(
            ["Hi!", "Hello.", "Hello there!", "Good morning!", "Hey", "hi", "Good evening."]
        )
        answer = rng.choice(
            [
                "Hello! How can I help you today?",
                "Hi! What can I do for you?",
                "Hello! What would you like to do?",
            ]
        )
        return greeting, answer, "to say hello"
    if kind == 1:
        thanks = rng.choice(
            ["Thanks!", "Thank you.", "thanks a lot", "Great, thank you!", "That helps, thanks."]
        )
        answer = rng.choice(
            [
                "You're welcome!",
                "You're welcome. Let me know if you need anything else.",
                "Glad I could help!",
            ]
        )
        return thanks, answer, "to thank me"
    if kind == 2:
        question = rng.choice(
            ["Who are you?", "What are you?", "Are you a person?", "Introduce yourself."]
        )
        answer = rng.choice(
            [
                "I am a small assistant that runs on this computer.",
                "I am a tiny language model that answers questions and calls tools.",
            ]
        )
        return question, answer, "to know who I am"
    if kind == 3:
        question = rng.choice(["What can you do?", "How can you help me?", "What are your skills?"])
        return (
            question,
            "I can answer short questions and call the tools you give me.",
            "to know what I can do",
        )
    if kind == 4:
        word = rng.choice(WORDS)
        return (
            rng.choice(
                [f"Say {word}.", f"Please say the word {word}.", f"Repeat after me: {word}"]
            ),
            f"{word.capitalize()}.",
            f"me to say {word}",
        )
    if kind == 5:
        country = rng.choice(list(CAPITALS))
        question = rng.choice(
            [f"What is the capital of {country}?", f"Which city is the capital of {country}?"]
        )
        return (
            question,
            f"The capital of {country} is {CAPITALS[country]}.",
            f"the capital of {country}",
        )
    if kind == 6:
        thing = rng.choice(list(COLORS))
        return (
            f"What color is {thing}?",
            f"{thing[0].upper() + thing[1:]} is {COLORS[thing]}.",
            f"the color of {thing}",
        )
    if kind == 7:
        n = rng.randint(2, 6)
        return (
            rng.choice([f"Count to {n}.", f"Count from 1 to {n}."]),
            ", ".join(str(i) for i in range(1, n + 1)) + ".",
            f"me to count to {n}",
        )
    if kind == 8:
        topic = rng.choice(TOPICS)
        question = rng.choice(
            [
                f"Tell me one thing about {topic}.",
                f"Write a sentence about {topic}.",
                f"Describe {topic} briefly.",
            ]
        )
        answer = rng.choice(
            [
                f"{topic[0].upper() + topic[1:]} is an interesting subject to learn about.",
                f"Many people enjoy learning about {topic}.",
            ]
        )
        return question, answer, f"a sentence about {topic}"
    request = rng.choice(
        ["Can you help me?", "I have a question.", "Are you there?", "Is this working?"]
    )
    answer = rng.choice(
        [
            "Yes, I am here. What do you need?",
            "Of course. What would you like to know?",
            "Yes, it works. How can I help?",
        ]
    )
    return request, answer, "help"


FILLER = [
    "Always read the existing code before you change it.",
    "Keep answers short and precise.",
    "Prefer small, reviewable changes.",
    "Never invent file names; check them first.",
    "Report what you did at the end of each task.",
    "Use the tools when they help.",
    "Do not run destructive commands without asking.",
    "Follow the style of the project.",
    "Write tests for new behaviour.",
    "Explain errors in plain words.",
    "Ask when a request is unclear.",
    "Respect the user's time and keep the output focused.",
    "Quote paths exactly as they appear.",
]


def _system_prompt(rng: random.Random, long: bool) -> str:
    if not long:
        return rng.choice(
            [
                "You are a helpful assistant.",
                "You are a coding agent.",
                "Be brief.",
                "You are a friendly assistant that uses tools when needed.",
            ]
        )
    lines = ["You are a coding agent working in a user's repository.", ""]
    for section in range(rng.randint(6, 30)):
        lines.append(f"# Rules part {section + 1}")
        lines.extend(rng.choice(FILLER) for _ in range(rng.randint(3, 8)))
        lines.append("")
    return "\n".join(lines)


def _filler_tool(rng: random.Random, i: int) -> dict[str, Any]:
    name = (
        rng.choice(["Task", "Notebook", "Cron", "Worktree", "Agent", "Skill", "Todo", "Plan"])
        + rng.choice(["Create", "Update", "List", "Stop", "Get", "Edit", "Delete", "Run"])
        + str(i)
    )
    props = {
        f"field_{j}": {
            "type": rng.choice(["string", "integer", "boolean"]),
            "description": rng.choice(FILLER),
        }
        for j in range(rng.randint(1, 5))
    }
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": " ".join(rng.choice(FILLER) for _ in range(rng.randint(1, 6))),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }


@dataclass
class OfferedTool:
    family: Family
    name: str
    params: list[str]
    spec: dict[str, Any]


EVAL_NAMES = {name for family in FAMILIES for name in family.eval_names}

# Words of the tool descriptions: keys for the copying exercises.
COPY_KEY_WORDS = sorted(
    {w.strip(".,").lower() for f in FAMILIES for d in f.descriptions for w in d.split()}
    | set(PARAM_WORDS)
)


def _tool_name(
    rng: random.Random, family: Family, split: str, taken: set[str], variety: bool
) -> str:
    if split == "eval" or not variety:
        pool = family.train_names if split == "train" else family.eval_names
        return rng.choice([n for n in pool if n not in taken] or pool)
    while True:
        name = rng.choice(family.train_names) if rng.random() < 0.2 else novel_name(rng)
        if name not in taken and name not in EVAL_NAMES:
            return name


def _param_name(
    rng: random.Random, options: list[str], split: str, taken: list[str], variety: bool
) -> str:
    if not variety:
        return rng.choice(options)
    while True:
        if split == "train" and rng.random() < 0.3:
            name = rng.choice(PARAM_WORDS)
        else:
            name = rng.choice(options)
        if name not in taken:
            return name


def _offer(
    rng: random.Random, family: Family, split: str, taken: set[str], variety: bool
) -> OfferedTool:
    name = _tool_name(rng, family, split, taken, variety)
    params: list[str] = []
    for options in family.params:
        params.append(_param_name(rng, options, split, params, variety))
    props: dict[str, Any] = {
        p: {"type": "string", "description": d}
        for p, d in zip(params, family.param_descriptions, strict=True)
    }
    for opt_name, opt_desc in family.optional:
        if rng.random() < 0.5:
            props[opt_name] = {"type": "string", "description": opt_desc}
    spec = {
        "type": "function",
        "function": {
            "name": name,
            "description": rng.choice(family.descriptions),
            "parameters": {"type": "object", "properties": props, "required": params},
        },
    }
    return OfferedTool(family, name, params, spec)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """Exactly how the chat template renders a call (so generation is prefix-stable)."""
    return (
        '<tool_call>{"name": "'
        + name
        + '", "arguments": '
        + json.dumps(arguments, ensure_ascii=False)
        + "}</tool_call>"
    )


@dataclass
class Sample:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    thinking: bool
    completion: str  # what the model generates after the generation prompt, before EOS
    kind: str  # plain | tool | tool2 | after_tool
    expected_tools: list[str] = field(default_factory=list)  # tool names, for evaluation
    required: list[list[str]] = field(default_factory=list)  # required params per call
    arguments: list[dict[str, Any]] = field(default_factory=list)  # expected, per call


def make_sample(
    rng: random.Random,
    split: str = "train",
    long_ratio: float = 0.03,
    variety: bool = False,
    names_in_reasoning: bool = False,
    two_call_ratio: float = 0.2,
) -> Sample:
    """One conversation and its completion. ``variety`` (training only) draws most
    tool names, many parameter names and argument values fresh per sample and puts
    the called tool anywhere in the list: copying from the prompt becomes the only
    way to get a call right (an experiment; see the README).

    ``names_in_reasoning`` makes the reasoning name the tool it will call (runs 1-9).
    Without it the reasoning says only *that* an offered tool fits: a name copied
    in free text has no constraint to keep it on an offered tool, and a failed copy
    there derailed every reasoning failure of run 9.

    ``two_call_ratio``: how often a request offering several tools asks for two
    calls. The eval keeps the default; training more of them targets run 9's weakest
    case (half of its two-call requests were wrong)."""
    long = rng.random() < long_ratio
    thinking = rng.random() < 0.3
    messages: list[dict[str, Any]] = []
    if long or rng.random() < 0.5:
        messages.append({"role": "system", "content": _system_prompt(rng, long)})
    if rng.random() < 0.2:  # an earlier, finished exchange
        question, answer, _ = _plain(rng)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]

    roll = rng.random()
    use_tools = roll < 0.75
    families = rng.sample(FAMILIES, k=min(len(FAMILIES), rng.randint(1, 5))) if use_tools else []
    taken: set[str] = set()
    offered = []
    for family in families:
        tool = _offer(rng, family, split, taken, variety)
        taken.add(tool.name)
        offered.append(tool)
    tools = [t.spec for t in offered]
    if use_tools and (long or rng.random() < 0.1):
        tools += [_filler_tool(rng, i) for i in range(rng.randint(5, 25 if long else 10))]
        rng.shuffle(tools)

    if not use_tools or rng.random() < 0.15:  # plain turn (tools may be offered but unrelated)
        question, answer, want = _plain(rng)
        messages.append({"role": "user", "content": question})
        reasoning = f"The user wants {want}. No tool is needed, so I will answer directly."
        return _finish(messages, tools or None, thinking, reasoning, answer, "plain", [], [])

    if variety:  # the called tool sits anywhere in the list, not first
        two = len(offered) > 1 and rng.random() < two_call_ratio
        chosen = rng.sample(offered, k=2 if two else 1)
    else:
        chosen = [offered[0]]
        if len(offered) > 1 and rng.random() < two_call_ratio:
            chosen.append(offered[1])
    novel = variety and split == "train" and rng.random() < 0.4
    values = [(NOVEL_VALUES[c.family.key] if novel else c.family.values)(rng) for c in chosen]
    requests = [
        rng.choice(c.family.requests).format(*v) for c, v in zip(chosen, values, strict=True)
    ]
    text = (
        requests[0]
        if len(requests) == 1
        else requests[0].rstrip(".?!")
        + rng.choice([" and ", ". Also, ", ", then "])
        + requests[1][0].lower()
        + requests[1][1:]
    )
    messages.append({"role": "user", "content": text})
    calls = [
        {"name": c.name, "arguments": dict(zip(c.params, v, strict=True))}
        for c, v in zip(chosen, values, strict=True)
    ]
    call_text = "".join(tool_call_text(call["name"], call["arguments"]) for call in calls)
    intents = " and ".join(c.family.intent.format(*v) for c, v in zip(chosen, values, strict=True))
    if names_in_reasoning:
        names = " and ".join(c.name for c in chosen)
        reasoning = f"The user wants {intents}. The tool {names} can do that, so I will call it."
    elif len(chosen) == 1:
        reasoning = f"The user wants {intents}. An offered tool can do that, so I will call it."
    else:
        reasoning = f"The user wants {intents}. Offered tools can do that, so I will call them."
    kind = "tool" if len(calls) == 1 else "tool2"

    if rng.random() < 0.35:  # the call was made already: answer from its results
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        results = [c.family.result(rng, v) for c, v in zip(chosen, values, strict=True)]
        for call, result in zip(calls, results, strict=True):
            messages.append({"role": "tool", "content": result, "tool_call_id": call["name"]})
        answer = " ".join(
            c.family.answer(v, r) for c, v, r in zip(chosen, values, results, strict=True)
        )
        reasoning = "The tool returned its result. I will tell the user what it says."
        return _finish(messages, tools, thinking, reasoning, answer, "after_tool", [], [])
    sample = _finish(
        messages,
        tools,
        thinking,
        reasoning,
        call_text,
        kind,
        [c["name"] for c in calls],
        [c.params for c in chosen],
    )
    sample.arguments = [c["arguments"] for c in calls]
    return sample


def _finish(messages, tools, thinking, reasoning, answer, kind, expected, required) -> Sample:
    completion = f"{reasoning}\n</think>\n\n{answer}" if thinking else answer
    return Sample(messages, tools, thinking, completion, kind, expected, required)


def corpus(seed: int, n: int, variety: bool = False, names_in_reasoning: bool = False) -> list[str]:
    """Text for training the BPE tokenizer."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        s = make_sample(
            rng, long_ratio=0.02, variety=variety, names_in_reasoning=names_in_reasoning
        )
        texts.extend(m["content"] for m in s.messages if m.get("content"))
        texts.append(s.completion)
        if s.tools:
            texts.extend(json.dumps(t) for t in s.tools[:3])
    return texts
