"""Write data/distill_prompts.jsonl: ~10,800 chat prompts for self-distillation of a draft head.

The prompts cover the twelve domains of the audit suite (suites/default.jsonl), 900 per domain. Every
prompt comes from a template family written for this project (its `source`, e.g.
"template:code/function-spec"), filled from pools of tasks, topics, names, numbers and sentences, and
from programmatically built code snippets, expressions, faulty sentences and passages. The small model
answers each prompt greedily and its answers become training data, so the families aim at what real
users ask, in many shapes and lengths, leading to answers of a hundred tokens or more.

Deterministic: one fixed seed (a separate random stream per domain), so

    python data/make_distill_prompts.py [--out PATH]

rewrites the file byte for byte identically. The script uses only the standard library and the
project's own package: every prompt is unique after normalisation (lower case, whitespace collapsed),
and a prompt is dropped when `lossless.reserved` says it clashes with an evaluation or training set
(the audit suite, the held-out and training prompts, the lm-eval tasks); the finished list is checked
again with `lossless.reserved.check_disjoint_all`, as training checks it. At the end a table of counts
and prompt lengths per domain is printed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lossless.training.distill import normalise  # noqa: E402
from lossless.training.reserved import check_disjoint_all, reserved_filter  # noqa: E402

SEED = 20260501
PER_DOMAIN = 900
MAX_TRIES_PER_PROMPT = 60  # a domain whose families cannot reach PER_DOMAIN distinct prompts fails loudly
LICENCE = "MIT (this project's)"
DEFAULT_OUT = ROOT / "data" / "distill_prompts.jsonl"
DOMAINS = ("code", "code_explanation", "math_word", "symbolic_math", "creative_writing", "poetry",
           "grammar_correction", "factual_qa", "advice", "translation", "summarisation", "instruction_following")

Family = Callable[[random.Random], str]
FAMILIES: dict[str, dict[str, tuple[Family, float]]] = {d: {} for d in DOMAINS}


def family(domain: str, name: str, weight: float = 1.0) -> Callable[[Family], Family]:
    """Register a prompt family: a function of a random stream that returns one prompt."""
    def register(fn: Family) -> Family:
        FAMILIES[domain][name] = (fn, weight)
        return fn
    return register


def some(rng: random.Random, pool: list, lo: int, hi: int) -> list:
    """Between lo and hi distinct items of pool, in random order."""
    return rng.sample(pool, rng.randint(lo, hi))


def sentences(*parts: str) -> str:
    """The non-empty parts joined by single spaces."""
    return " ".join(p for p in parts if p)


def fenced(lang: str, snippet: str) -> str:
    return f"```{lang}\n{snippet}\n```"


NAMES = ["Maya", "Liam", "Aisha", "Tomás", "Priya", "Jonah", "Mei", "Kwame", "Sofia", "Daniel", "Leila", "Oscar",
         "Hana", "Mateo", "Zara", "Ethan", "Amara", "Lucas", "Yuki", "Noah", "Fatima", "Ravi", "Elena", "Samuel",
         "Chloe", "Arjun", "Nadia", "Felix", "Ingrid", "Marcus", "Lucia", "Kofi", "Anya", "Diego", "Grace", "Omar",
         "Ruth", "Tariq", "Isla", "Pablo", "Wen", "Hugo", "Bianca", "Kenji", "Esther", "Malik", "Olivia", "Carlos"]


def person(rng: random.Random) -> tuple[str, str, str, str]:
    """A name with its pronouns (subject, object, possessive); NAMES alternates women's and men's names."""
    i = rng.randrange(len(NAMES))
    return (NAMES[i], "she", "her", "her") if i % 2 == 0 else (NAMES[i], "he", "him", "his")


CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Melbourne", "Lyon", "Valencia", "Krakow", "Edinburgh",
          "Montreal", "Seville", "Porto", "Hamburg", "Bologna", "Cape Town", "Vancouver", "Glasgow", "Dublin",
          "Munich", "Barcelona", "Leeds", "Chicago", "Denver", "Auckland", "Gothenburg", "Marseille", "Turin"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


# ================================================================================================ code
PY_TASKS = [
    ("initials(full_name)", "returns the initials of a full name, such as 'A.B.C.' for 'ada byron clarke'"),
    ("is_isogram(word)", "checks whether a word has no repeating letters, ignoring hyphens and case"),
    ("word_frequencies(text)", "returns a dictionary mapping each word to the number of times it appears, ignoring "
                               "case and punctuation"),
    ("flatten(nested)", "flattens an arbitrarily nested list of lists into a single flat list"),
    ("chunk(items, size)", "splits a list into consecutive chunks of the given size, where the last chunk may be "
                           "shorter"),
    ("closest_to_zero(numbers)", "returns the number closest to zero, preferring the positive one on ties"),
    ("merge_sorted(a, b)", "merges two already sorted lists into one sorted list without calling sort"),
    ("rotate_list(items, k)", "rotates a list k positions to the right, where k may be larger than the list"),
    ("dedupe_keep_order(items)", "removes repeated items from a list, keeping the first occurrence of each in order"),
    ("convert_temperature(value, unit)", "converts a temperature between Celsius and Fahrenheit depending on whether "
                                         "unit is 'C' or 'F'"),
    ("is_perfect_square(n)", "checks whether a non-negative integer is a perfect square without using floating point"),
    ("twin_primes(limit)", "returns all pairs of twin primes, such as (11, 13), below limit"),
    ("fizzbuzz_lines(n)", "returns a list of strings for 1 to n following the classic FizzBuzz rules"),
    ("vigenere_encrypt(text, key)", "encrypts text with a Vigenere cipher, leaving non-letters unchanged"),
    ("is_pangram(text)", "checks whether a sentence uses every letter of the alphabet at least once"),
    ("group_anagrams(words)", "groups a list of words into lists of words that are anagrams of each other"),
    ("average_word_length(sentence)", "returns the average length of the words in a sentence, ignoring "
                                      "punctuation"),
    ("title_case(text)", "capitalises every word except short words like 'a', 'of' and 'the', unless they come first"),
    ("run_length_encode(text)", "compresses a string with run-length encoding, so 'aaabcc' becomes 'a3b1c2'"),
    ("run_length_decode(encoded)", "reverses run-length encoding, turning 'a3b1c2' back into 'aaabcc'"),
    ("tags_are_nested(html)", "checks whether simple HTML-like tags such as <b> and </b> are properly nested"),
    ("binary_search(items, target)", "returns the index of target in a sorted list, or -1 if it is absent, using "
                                     "binary search"),
    ("moving_average(values, window)", "returns the list of averages over a sliding window of the given size"),
    ("trimmed_mean(numbers, fraction)", "returns the mean after dropping the given fraction of the smallest and "
                                         "largest values"),
    ("mode(numbers)", "returns the most common value in a list, and the smallest of them if several tie"),
    ("digital_root(n)", "repeatedly sums the digits of n until a single digit remains"),
    ("reverse_words(sentence)", "reverses the order of the words in a sentence while keeping each word intact"),
    ("capitalize_sentences(text)", "capitalises the first letter of each sentence in a paragraph"),
    ("file_stats(path)", "reads a text file and returns the number of lines, words and characters"),
    ("parse_csv_line(line)", "splits one CSV line into fields, handling quoted fields that contain commas"),
    ("looks_like_email(address)", "does a simple sanity check of an email address: exactly one @, a dot in the domain "
                                  "and no spaces"),
    ("slugify(title)", "turns a title into a URL slug: lowercase, punctuation removed, words joined by hyphens"),
    ("roman_to_int(numeral)", "converts a Roman numeral such as 'MCMXCIV' to an integer"),
    ("number_to_words(n)", "spells out an integer from 0 to 999 in English words"),
    ("binary_to_int(bits)", "converts a string of 0s and 1s to an integer without using int(bits, 2)"),
    ("reduce_fraction(numerator, denominator)", "returns a fraction in lowest terms as a (numerator, "
                                                "denominator) tuple"),
    ("lcm_of_list(numbers)", "returns the least common multiple of a list of positive integers"),
    ("factorial(n)", "computes n! iteratively and raises a ValueError for negative n"),
    ("look_and_say(n)", "returns the first n terms of the look-and-say sequence as strings"),
    ("transpose(matrix)", "transposes a matrix given as a list of lists"),
    ("matrix_multiply(a, b)", "multiplies two matrices given as lists of lists, checking that their dimensions match"),
    ("invert_dict(mapping)",
     "swaps the keys and values of a dictionary, collecting keys that share a value into a list"),
    ("deep_merge(a, b)", "recursively merges two dictionaries, with values from b winning on conflicts"),
    ("top_k(items, k)", "returns the k most common elements of a list, most common first"),
    ("pairs_with_sum(numbers, target)", "finds all pairs of numbers in a list that add up to target, without repeating "
                                        "pairs"),
    ("missing_number(numbers)",
     "finds the one number missing from a list that should contain every integer from 0 to n"),
    ("longest_palindromic_substring(text)", "returns the longest substring that reads the same forwards and "
                                            "backwards"),
    ("is_leap_year(year)", "checks whether a year is a leap year in the Gregorian calendar"),
    ("days_between(date1, date2)", "returns the number of days between two dates given as 'YYYY-MM-DD' strings"),
    ("format_file_size(num_bytes)", "turns a number of bytes into a readable string such as '1.5 MB'"),
    ("parse_duration(text)", "parses strings like '1h30m' or '45s' into a number of seconds"),
    ("password_strength(password)", "rates a password as 'weak', 'medium' or 'strong' from its length and the kinds of "
                                    "characters it uses"),
    ("generate_password(length)", "generates a random password containing letters, digits and symbols, using the "
                                  "secrets module"),
    ("count_lines_containing(path, word)", "counts the lines of a text file that contain a given word"),
    ("load_config(path, defaults)", "loads a JSON configuration file and fills in missing keys from a dictionary of "
                                    "defaults"),
    ("normalize_whitespace(text)", "collapses runs of whitespace into single spaces and trims both ends"),
    ("truncate(text, limit)", "shortens text to at most limit characters, cutting at a word boundary and adding '...'"),
    ("wrap_text(text, width)", "wraps text into lines no longer than width characters without splitting words"),
    ("print_bar_chart(values)", "prints a text bar chart with one row of asterisks for each distinct value"),
    ("bubble_sort(items)", "sorts a list in place with bubble sort and stops early when a pass makes no swaps"),
    ("insertion_sort(items)", "returns a new list sorted with insertion sort"),
    ("kth_smallest(items, k)", "returns the k-th smallest element of an unsorted list"),
    ("pad_and_pair(a, b, fill)", "pairs up the items of two lists, padding the shorter list with fill"),
    ("interleave(a, b)", "interleaves two lists and appends the leftover items of the longer one at the end"),
    ("running_total(numbers)", "returns the list of cumulative sums of a list of numbers"),
    ("is_arithmetic(numbers)", "checks whether a list of numbers forms an arithmetic progression"),
    ("count_islands(grid)", "counts the groups of connected 1s in a 2D grid of 0s and 1s, where cells connect up, "
                            "down, left and right"),
    ("shortest_path(graph, start, goal)", "finds the shortest path in an unweighted graph given as an adjacency "
                                          "dictionary, using breadth-first search"),
    ("topological_order(dependencies)", "orders tasks so that each comes after its dependencies, raising an error if "
                                        "there is a cycle"),
    ("is_valid_sudoku(board)", "checks whether a filled 9x9 Sudoku board follows the rules"),
    ("spiral_order(matrix)", "returns the elements of a matrix in clockwise spiral order"),
    ("pascal_triangle(n)", "returns the first n rows of Pascal's triangle"),
    ("collatz_steps(n)", "returns how many steps the Collatz sequence takes to reach 1 starting from n"),
    ("perfect_numbers(limit)", "returns all perfect numbers below limit"),
    ("armstrong_numbers(limit)", "returns all Armstrong (narcissistic) numbers below limit"),
    ("compound_interest(principal, rate, years)", "returns the final balance with yearly compounding, rounded to two "
                                                  "decimals"),
    ("monthly_payment(principal, annual_rate, months)", "computes the fixed monthly payment of a loan"),
    ("bmi_category(weight_kg, height_m)", "computes the body mass index and returns its category as a string"),
    ("grade_statistics(scores)", "returns the highest, lowest and average score and how many scores are above "
                                 "the average"),
    ("split_bill(total, people, tip_percent)", "returns how much each person pays, tip included, rounded to the cent"),
    ("count_char_types(text)",
     "returns the counts of uppercase letters, lowercase letters, digits and other characters"),
    ("most_frequent_char(text)", "returns the most frequent character in a string, ignoring spaces"),
    ("first_unique_char(text)", "returns the index of the first character that appears only once, or -1 if there is "
                                "none"),
    ("longest_common_prefix(words)", "returns the longest prefix shared by all the strings in a list"),
    ("longest_increasing_run(numbers)", "returns the longest run of strictly increasing consecutive values in a list"),
    ("edit_distance(a, b)", "computes the Levenshtein edit distance between two strings"),
    ("parse_query_string(query)", "turns a URL query string like 'a=1&b=2' into a dictionary"),
    ("extract_hashtags(text)", "returns all the hashtags in a piece of text, without duplicates, in order of first "
                               "appearance"),
    ("extract_numbers(text)", "finds all the integers and decimal numbers in a string and returns them as floats"),
    ("mask_card_number(number)", "hides all but the last four digits of a card number with asterisks"),
    ("luhn_check(number)", "validates a credit card number with the Luhn algorithm"),
    ("time_to_minutes(time_str)", "converts a time like '14:35' into the number of minutes after midnight"),
    ("next_weekday(date, weekday)", "returns the date of the next given weekday after a date"),
    ("group_by_key(records, key)", "groups a list of dictionaries by the value of one key"),
    ("sort_records(records, fields)", "sorts a list of dictionaries by several fields in order of priority"),
    ("add_prefix(folder, prefix)", "adds a prefix to the name of every file in a folder, skipping files that already "
                                   "have it"),
    ("find_large_files(folder, min_mb)", "walks a directory tree and returns the paths of files larger than min_mb "
                                         "megabytes"),
    ("retry(func, attempts, delay)", "calls a function and retries it when it raises, waiting delay seconds between "
                                     "attempts"),
    ("memoize(func)", "works as a decorator that caches a function's results by its arguments"),
    ("read_in_chunks(path, size)", "yields a file's contents in chunks of size bytes, as a generator"),
    ("batched(iterable, n)", "yields lists of n items from any iterable, including generators"),
    ("nth_prime(n)", "returns the n-th prime number"),
    ("replace_nth(text, old, new, n)", "replaces only the n-th occurrence of a substring in a string"),
    ("camel_to_snake(name)", "converts camelCase identifiers to snake_case"),
    ("snake_to_camel(name)", "converts snake_case identifiers to camelCase"),
    ("pig_latin(sentence)", "translates a sentence into Pig Latin"),
    ("weighted_choice(options, weights)", "picks a random option with probability proportional to its weight, without "
                                          "using random.choices"),
    ("tic_tac_toe_winner(board)", "returns 'X', 'O' or None for a 3x3 tic-tac-toe board given as a list of strings"),
    ("can_spell(letters, word)", "checks whether a word can be spelled using each of the given letters at most once"),
    ("best_profit(prices)", "returns the maximum profit from buying once and selling once later, given a list of daily "
                            "prices"),
    ("merge_intervals(intervals)", "merges overlapping intervals given as (start, end) pairs"),
    ("words_by_length(text)", "returns a dictionary mapping each word length to the number of words of that length"),
]
PY_CONSTRAINTS = [
    "Include a docstring and a couple of example calls.", "Add type hints.", "Don't use any imports.",
    "Use only the standard library.", "Explain how it works after the code.", "Handle empty input sensibly.",
    "Keep it readable; I'm a beginner.", "Include a few assert statements that test it.",
    "Also write some pytest tests for it.", "Say what its time complexity is.", "Raise a ValueError for invalid input.",
    "Add comments explaining the tricky parts.", "Show the output for one example input.",
    "Keep it short, ideally under 20 lines.", "Follow PEP 8.", "Mention any edge cases you considered.",
]
PY_SPEC_TEMPLATES = [
    "Write a Python function `{sig}` that {desc}.",
    "Implement `{sig}` in Python. The function {desc}.",
    "Can you write me a Python function called `{name}` that {desc}?",
    "I need a Python helper, `{sig}`, that {desc}.",
    "Write Python code for a function that {desc}. Name it `{name}`.",
    "Create a function in Python named `{name}`: it {desc}.",
    "How would I write a Python function that {desc}? Please show the code.",
    "In Python, write `{sig}`, which {desc}.",
    "Please write a function `{sig}` in Python 3 that {desc}.",
    "Python question: I want a function that {desc}. Could you write it as `{sig}`?",
]


@family("code", "function-spec", weight=3)
def code_function_spec(rng):
    sig, desc = rng.choice(PY_TASKS)
    text = rng.choice(PY_SPEC_TEMPLATES).format(sig=sig, name=sig.split("(")[0], desc=desc)
    return sentences(text, *some(rng, PY_CONSTRAINTS, 0, 2))


@family("code", "function-with-tests")
def code_function_tests(rng):
    sig, desc = rng.choice(PY_TASKS)
    template = rng.choice([
        "Write a Python function `{sig}` that {desc}, then write pytest tests covering normal cases and edge cases.",
        "Using test-driven development, first write unit tests and then the implementation for a Python function "
        "`{sig}` that {desc}.",
        "Write `{sig}` in Python, a function that {desc}, together with a unittest.TestCase that checks it.",
        "I'd like a Python function that {desc}. Please give the function and at least four tests, and explain what "
        "each test checks.",
    ])
    return template.format(sig=sig, desc=desc)


PY_CLASSES = [
    ("a `BankAccount` class", "that has deposit, withdraw and balance methods and refuses withdrawals that would "
                              "overdraw the account"),
    ("a `Stack` class", "backed by a list, with push, pop, peek and is_empty, raising a clear error when popping an "
                        "empty stack"),
    ("a `Queue` class", "implemented with two stacks, with enqueue, dequeue and len support"),
    ("an `LRUCache` class", "with get and put methods and a fixed capacity that evicts the least recently used item"),
    ("a `Matrix` class", "that supports addition, multiplication and transposition and has a readable __repr__"),
    ("a `Rational` class", "that keeps fractions in lowest terms and supports +, -, * and / with operator overloading"),
    ("a `Vector2D` class", "with addition, scalar multiplication, length and dot product, using operator overloading"),
    ("a `TodoList` class", "that can add tasks, mark them as done, and list the pending ones"),
    ("an `Inventory` class", "for a small shop that tracks item quantities and warns when stock runs low"),
    ("a `Temperature` class", "that stores a value in Celsius and exposes Fahrenheit and Kelvin as properties"),
    ("a `Timer` class", "usable as a context manager that prints how long the block inside it took"),
    ("a `RateLimiter` class", "that allows at most N calls per second and tells the caller when to wait"),
    ("a `Library` class", "that tracks books, members and loans and prevents a book from being lent twice"),
    ("a `ShoppingCart` class", "with items, quantities, an optional discount code and a method that returns the total"),
    ("a `LinkedList` class", "(singly linked) with append, prepend, remove and support for iteration"),
    ("a `BinarySearchTree` class", "with insert, contains and an in-order traversal"),
    ("a `Graph` class", "with add_edge, neighbors and a breadth-first search method"),
    ("a `Polynomial` class", "that can be evaluated at a point, added to another polynomial and differentiated"),
    ("a `Deck` class", "of 52 playing cards with shuffle and deal methods"),
    ("an `EventScheduler` class", "that stores events with their times and returns the upcoming ones in order"),
    ("a `PriorityQueue` class", "built on the heapq module, with push, pop and peek"),
    ("a `Student` class", "with a name and a list of grades, plus methods for the average and the best grade"),
    ("a `Rectangle` class and a `Square` subclass", "each with area and perimeter methods"),
    ("an abstract `Shape` base class", "with `Circle` and `Triangle` subclasses that implement area()"),
    ("a `Recipe` class", "that stores ingredients with quantities and can scale them to a new number of servings"),
    ("a `Timetable` class", "that stores train departures and finds the next one after a given time"),
    ("a `ParkingLot` class", "with a fixed number of spaces, park and leave methods, and a count of free spaces"),
    ("a `Thermostat` class", "that keeps a target temperature within safe limits and reports whether heating should be "
                             "on"),
    ("a `Counter`-like `WordTally` class", "that reads text incrementally and reports the most common words"),
    ("a `Dice` class", "that rolls any number of dice with any number of sides and keeps a history of rolls"),
]


CLASS_EXTRAS = ["Add type hints.", "Include a __repr__.", "Write a couple of tests for it.", "Keep it simple.",
                "Explain each method briefly."]


@family("code", "python-class")
def code_python_class(rng):
    noun, rest = rng.choice(PY_CLASSES)
    template = rng.choice([
        "Write {noun} in Python {rest}.",
        "Design {noun} in Python {rest}. Show a short example of using it.",
        "Can you code {noun} {rest}? Please include docstrings.",
        "I'm practising object-oriented Python. Write {noun} {rest}, and explain your design choices.",
        "Create {noun} {rest}. Use dataclasses where they make sense.",
        "Show me how to implement {noun} {rest} in Python, with a few lines of example usage at the end.",
    ])
    return sentences(template.format(noun=noun, rest=rest), *some(rng, CLASS_EXTRAS, 0, 1))


PY_SCRIPTS = [
    "reads a CSV file of expenses (date, category, amount) and prints the total spent per category",
    "renames all the .jpeg files in a folder to .jpg",
    "checks a list of URLs from a text file and reports which ones return an error status",
    "counts the words in every .txt file in a folder and prints the files from longest to shortest",
    "backs up a folder into a zip file whose name includes today's date",
    "plays a number-guessing game in the terminal, giving 'higher' or 'lower' hints",
    "asks for the user's birthdate and prints their age in years, months and days",
    "reads a web server log and prints the ten most frequent IP addresses",
    "merges several CSV files that have the same columns into one file",
    "converts a JSON file containing a list of objects into a CSV file",
    "finds duplicate files in a folder by comparing their hashes",
    "prints a multiplication table up to 12 with neatly aligned columns",
    "simulates rolling two dice 10,000 times and prints how often each total appears",
    "keeps a to-do list in a text file and lets the user add, complete and list tasks",
    "extracts all the links from a local HTML file using html.parser",
    "watches a folder and prints the name of any new file that appears, checking every five seconds",
    "prints a calendar for a year and month given on the command line",
    "takes a text file and writes a copy with every line numbered",
    "reads daily temperatures from a CSV file and plots them with matplotlib, with labelled axes",
    "uses argparse to accept an input file and an optional --uppercase flag, then prints the file",
    "creates an SQLite database with a table of books and inserts a few sample rows",
    "reads numbers typed by the user until a blank line and prints their average, minimum and maximum",
    "sorts the lines of a file alphabetically and removes blank lines",
    "reads a CSV of student scores and writes a report with each student's average and letter grade",
    "works as a command-line stopwatch that starts and stops when you press Enter",
    "splits a large text file into smaller files of 1,000 lines each",
    "finds all the email addresses in a text file with a regular expression",
    "compares two text files and prints the lines that differ, using difflib",
    "serves the current folder over HTTP on port 8000 using only the standard library",
    "generates a random quiz of ten arithmetic questions and reports the score at the end",
    "organises the files in a Downloads folder into subfolders by file type",
    "reads a list of birthdays from a file and prints whose birthday is coming up next",
]


@family("code", "python-script")
def code_python_script(rng):
    task = rng.choice(PY_SCRIPTS)
    template = rng.choice([
        "Write a Python script that {t}.",
        "Could you write a short Python program that {t}? Explain how to run it.",
        "I want a Python script that {t}. Keep it simple and add comments.",
        "Give me a Python program which {t}.",
        "How can I write a Python script that {t}? Walk me through the code.",
        "Write a small command-line tool in Python that {t}. Handle errors such as a missing file.",
    ])
    return template.format(t=task)


JS_TASKS = [
    "debounces another function, delaying calls until a given number of milliseconds has passed without a new call",
    "deep-clones a plain object containing nested objects and arrays",
    "formats a number as a currency string with thousands separators and two decimals",
    "checks whether two arrays contain the same elements, ignoring order",
    "groups an array of objects by a property name",
    "returns the unique values of an array while keeping their order",
    "capitalises the first letter of every word in a string",
    "counts the occurrences of each character in a string and returns them as an object",
    "fetches JSON from a URL with fetch and async/await and handles network errors",
    "validates a sign-up form's email and password fields and shows error messages",
    "turns a date into a 'time ago' string such as '5 minutes ago'",
    "flattens a nested array to any depth without using Array.prototype.flat",
    "throttles another function so it runs at most once every N milliseconds",
    "sorts an array of objects by a date property, newest first",
    "generates a random hex colour code",
    "returns the intersection of two arrays",
    "checks whether a string is a valid IPv4 address",
    "parses a query string into an object",
    "splits an array into smaller arrays of a given size",
    "implements a small event emitter with on, off and emit",
    "retries a promise-returning function up to three times before giving up",
    "toggles a dark-mode class on the page and remembers the choice in localStorage",
    "counts down from a given number of seconds and updates an element's text every second",
    "sums a given numeric property over an array of objects using reduce",
    "converts a string to kebab-case",
    "finds the most frequent element of an array",
    "memoizes any single-argument function",
    "shuffles an array in place with the Fisher-Yates algorithm",
    "checks whether a string is a valid hex colour code",
    "returns the number of days from today until a given date",
]


@family("code", "javascript")
def code_javascript(rng):
    task = rng.choice(JS_TASKS)
    template = rng.choice([
        "Write a JavaScript function that {t}.",
        "How do I write a JS function that {t}? Please include an example call.",
        "In modern JavaScript, write a function that {t}.",
        "Write a TypeScript function that {t}, with proper types.",
        "Can you show me a JavaScript function that {t}, and explain how it works?",
        "I'm building a small web app and need a function that {t}. Can you write it in plain JavaScript?",
    ])
    return template.format(t=task)


SQL_SCHEMAS = [
    ("customers(id, name, city, signup_date) and orders(id, customer_id, order_date, total)", [
        "list the five customers who have spent the most in total",
        "count the orders placed in each month of 2024",
        "find customers who have never placed an order",
        "show the average order total for each city",
        "find the date of each customer's most recent order",
        "list the customers who placed more than three orders last year",
    ]),
    ("employees(id, name, department_id, salary, hire_date, manager_id) and departments(id, name)", [
        "find the highest-paid employee in each department",
        "list departments whose average salary is above 60,000",
        "show each employee next to the name of their manager",
        "count how many people were hired in each year",
        "find employees who earn more than their manager",
        "rank the employees within each department by salary",
    ]),
    ("students(id, name, year), courses(id, title, credits) and enrollments(student_id, course_id, grade)", [
        "list each student with the number of courses they are taking",
        "find the course with the most enrolled students",
        "compute each student's average grade, highest first",
        "find students who are not enrolled in any course",
        "list the courses in which every grade is at least 70",
    ]),
    ("products(id, name, category, price) and sales(id, product_id, sold_at, quantity)", [
        "find the total revenue per category",
        "list products that have not sold at all in the last 30 days",
        "show the three best-selling products by quantity in each category",
        "compute the total quantity sold per week",
        "find the product categories whose revenue grew from last month to this month",
    ]),
    ("books(id, title, author_id, published_year), authors(id, name, country) and loans(id, book_id, member_id, "
     "loan_date, return_date)", [
        "list the ten most borrowed books",
        "find the books that are currently on loan",
        "count the authors from each country",
        "find members who have a loan more than 21 days overdue",
        "show, for each author, their oldest book",
    ]),
    ("flights(id, origin, destination, departure_time, arrival_time, price)", [
        "find the cheapest flight between every pair of cities",
        "list the routes with more than ten flights per week",
        "compute the average flight duration per route",
        "find all flights that leave after 6 p.m. and cost less than 100",
    ]),
]


@family("code", "sql")
def code_sql(rng):
    schema, queries = rng.choice(SQL_SCHEMAS)
    query = rng.choice(queries)
    template = rng.choice([
        "Given the tables {s}, write a SQL query to {q}.",
        "I have a database with {s}. How do I {q} in SQL? Explain the query.",
        "Write a PostgreSQL query to {q}. The tables are {s}.",
        "SQL help: with tables {s}, I need to {q}. Can you write the query and explain each clause?",
        "Using the schema {s}, write a query to {q}, and say which index would make it faster.",
    ])
    return template.format(s=schema, q=query)


SHELL_TASKS = [
    "finds all files larger than 100 MB under the home directory",
    "counts the lines in every .py file of a project and prints the total",
    "renames all the files in a folder to lowercase",
    "backs up a directory to a tarball named with the current date",
    "deletes log files older than 30 days",
    "checks whether a website responds and prints a warning if it does not",
    "prints the ten largest directories inside the current folder",
    "replaces a word in every .txt file of a directory",
    "warns when disk usage goes above 90 percent",
    "pings each server in a list once and reports which ones are down",
    "extracts the second column of a CSV file and prints its unique values sorted",
    "counts how many times each HTTP status code appears in an access log",
    "creates a new project folder with src, tests and docs subfolders and an empty README",
    "lists the duplicate lines of a text file",
    "converts all the .png images in a folder to .jpg with ImageMagick",
    "prints the current git branch and the number of uncommitted changes",
    "prints each line of a file with its line number",
    "waits until a given port on localhost is open, then exits",
    "shows the five processes using the most memory",
    "compresses every subfolder of the current folder into its own zip file",
    "asks for a name and greets the user, refusing empty input",
    "prints how many files of each extension a directory contains",
    "runs a command and retries it up to five times if it fails",
    "downloads every URL listed in a text file with curl",
]


@family("code", "shell")
def code_shell(rng):
    task = rng.choice(SHELL_TASKS)
    template = rng.choice([
        "Write a bash script that {t}.",
        "What's a shell one-liner that {t}? Explain each part.",
        "Can you write a Bash script that {t}? Add comments so I can follow it.",
        "I use Linux. Give me a command or small script that {t}.",
        "Write a POSIX sh script that {t}, and explain how to make it executable.",
    ])
    return template.format(t=task)


C_TASKS = [
    "reverses a string in place", "counts the words in a string separated by spaces",
    "returns the maximum value in an integer array", "checks whether a year is a leap year",
    "computes the length of a string without using strlen",
    "copies a string into a buffer safely, never writing past the end of the buffer",
    "sorts an integer array with selection sort",
    "converts a string of digits into an int, handling a leading minus sign",
    "removes all the spaces from a string in place", "reads a text file and counts its lines",
    "rotates an integer array left by k positions", "computes the average of an array of doubles",
    "converts a string to uppercase in place", "computes a power of a number by repeated squaring",
    "counts how many times a character appears in a string", "counts the set bits in an unsigned integer",
    "allocates a two-dimensional matrix dynamically and later frees it", "reverses a singly linked list",
    "concatenates two strings into a newly allocated buffer", "implements a stack of integers with push and pop",
]


@family("code", "c")
def code_c(rng):
    task = rng.choice(C_TASKS)
    template = rng.choice([
        "Write a C function that {t}.",
        "In C, how would I write a function that {t}? Please explain the pointer handling.",
        "Write a small C program with a function that {t}, plus a main that tests it.",
        "Can you write a C function that {t} and point out any memory-safety pitfalls?",
    ])
    return template.format(t=task)


ALGORITHMS = [
    "merge sort", "quicksort", "binary search, both iteratively and recursively", "breadth-first search on a grid",
    "depth-first search on a graph", "Dijkstra's shortest-path algorithm", "a trie with insert and search",
    "a min-heap from scratch", "union-find with path compression",
    "a dynamic-programming solution to the 0/1 knapsack problem",
    "a dynamic-programming solution for the longest common subsequence of two strings",
    "Prim's minimum spanning tree algorithm", "a hash map with separate chaining",
    "matrix exponentiation for computing Fibonacci numbers quickly", "a backtracking solver for the N-Queens problem",
    "a Sudoku solver using backtracking", "Kruskal's minimum spanning tree algorithm", "counting sort",
    "the two-pointer technique for finding a pair with a given sum in a sorted list", "a sliding-window maximum",
    "a circular buffer", "Floyd's cycle detection on a linked list",
    "a dynamic-programming solution to the coin change problem (fewest coins)", "radix sort", "A* search on a grid",
    "a level-order traversal of a binary tree", "a recursive solution to the Tower of Hanoi", "heap sort",
    "a binary search tree with deletion", "the KMP string-matching algorithm",
    "the Levenshtein edit-distance algorithm",
]


@family("code", "algorithm")
def code_algorithm(rng):
    algo = rng.choice(ALGORITHMS)
    lang = rng.choice(["Python", "Python", "Python", "JavaScript", "C", "Java", "Go"])
    template = rng.choice([
        "Implement {a} in {l} and explain its time complexity.",
        "Can you show me {a} in {l}, with comments?",
        "Explain {a} briefly and then implement it in {l}.",
        "Write {a} in {l}. Include a small example that shows it working.",
        "I have a coding interview next week. Walk me through {a} and write a clean {l} implementation.",
    ])
    return template.format(a=algo, l=lang)


# ==================================================================================== code_explanation
WORDS = ["banana", "rhythm", "committee", "balloon", "python", "keyboard", "mississippi", "lighthouse",
         "parallel", "avocado", "bookkeeper", "orange", "strawberry", "level", "racecar", "notebook", "umbrella",
         "giraffe", "Hello World", "data science", "open source", "abracadabra", "teapot", "summer holiday"]
FRUITS = ["apple", "banana", "cherry", "kiwi", "mango", "pear", "plum", "fig", "grape", "lemon", "lime", "melon"]
SENTENCE_WORDS = ["the cat sat on the mat and the dog sat on the cat",
                  "to be or not to be that is the question",
                  "red blue red green blue red yellow",
                  "one fish two fish red fish blue fish",
                  "the quick brown fox jumps over the lazy dog the end",
                  "apple pie and apple juice and pear juice",
                  "a rose is a rose is a rose",
                  "buy milk buy eggs call mum buy bread"]


def _nums(rng, lo=1, hi=30, n=(5, 8)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def code(template: str, **fills) -> str:
    """A snippet from an indented triple-quoted template: dedented, outer blank lines dropped, then filled."""
    return textwrap.dedent(template).strip("\n").format(**fills)


def py_comprehension(rng):
    nums = _nums(rng)
    expr = rng.choice(["n * 2", "n ** 2", "n + 1", "n // 2", "n % 5", "-n", "str(n)"])
    cond = rng.choice(["n % 2 == 0", "n % 2 == 1", f"n > {rng.randint(5, 20)}", "n % 3 != 0",
                       f"n < {rng.randint(8, 25)}"])
    var = rng.choice(["result", "values", "out", "picked"])
    return code("""
        nums = {nums}
        {var} = [{expr} for n in nums if {cond}]
        print({var})
        """, nums=nums, var=var, expr=expr, cond=cond)


def py_loop_accumulate(rng):
    start, stop = rng.randint(0, 5), rng.randint(10, 30)
    k = rng.randint(2, 7)
    limit = rng.randint(40, 200)
    body = rng.choice([
        f"    if i % {k} == 0:\n        total += i",
        f"    if i % {k} == 0:\n        continue\n    total += 1",
        f"    total += i * {k}\n    if total > {limit}:\n        break",
        "    if i % 2:\n        total -= i\n    else:\n        total += i",
    ])
    return code("""
        total = 0
        for i in range({start}, {stop}):
        {body}
        print(total)
        """, start=start, stop=stop, body=body)


def py_while(rng):
    kind = rng.randrange(3)
    if kind == 0:
        return code("""
            n = {n}
            steps = 0
            while n != 1:
                n = n // 2 if n % 2 == 0 else 3 * n + 1
                steps += 1
            print(steps)
            """, n=rng.randint(6, 40))
    if kind == 1:
        return code("""
            n = {n}
            rev = 0
            while n > 0:
                rev = rev * 10 + n % 10
                n //= 10
            print(rev)
            """, n=rng.randint(1000, 99999))
    a, b = rng.randint(1, 5), rng.randint(50, 500)
    return code("""
        x = {a}
        count = 0
        while x < {b}:
            x *= 2
            count += 1
        print(x, count)
        """, a=a, b=b)


def py_string_ops(rng):
    word = rng.choice(WORDS)
    ops = some(rng, ["s[::-1]", "s.upper()", "s[1:4]", "s.count('a')", "'-'.join(s)", "s.replace('e', '3')",
                     "sorted(s)", "s.title()", "len(s)", "s.find('o')", "s[-3:]", "s.split()", "s * 2",
                     "s.startswith('b')", "''.join(sorted(set(s)))"], 2, 4)
    return "\n".join([f"s = {word!r}"] + [f"print({op})" for op in ops])


RECURSION_SNIPPETS = [
    ("""
     def fact(n):
         if n <= 1:
             return 1
         return n * fact(n - 1)

     print(fact({a}))
     """, (3, 8)),
    ("""
     def digit_sum(n):
         if n < 10:
             return n
         return n % 10 + digit_sum(n // 10)

     print(digit_sum({a}))
     """, (100, 99999)),
    ("""
     def power(base, exp):
         if exp == 0:
             return 1
         half = power(base, exp // 2)
         return half * half * (base if exp % 2 else 1)

     print(power(2, {a}))
     """, (3, 12)),
    ("""
     def fib(n):
         if n < 2:
             return n
         return fib(n - 1) + fib(n - 2)

     print([fib(i) for i in range({a})])
     """, (5, 10)),
    ("""
     def countdown(n):
         if n == 0:
             print('liftoff')
             return
         print(n)
         countdown(n - 1)

     countdown({a})
     """, (2, 5)),
    ("""
     def to_binary(n):
         if n < 2:
             return str(n)
         return to_binary(n // 2) + str(n % 2)

     print(to_binary({a}))
     """, (5, 200)),
    ("""
     def gcd(a, b):
         return a if b == 0 else gcd(b, a % b)

     print(gcd({a}, {b}))
     """, (12, 120)),
    ("""
     def reverse(s):
         if s == '':
             return s
         return reverse(s[1:]) + s[0]

     print(reverse({w!r}))
     """, (0, 0)),
    ("""
     def depth(x):
         if not isinstance(x, list):
             return 0
         return 1 + max((depth(i) for i in x), default=0)

     print(depth({nested}))
     """, (0, 0)),
]


def py_recursion(rng):
    template, (lo, hi) = rng.choice(RECURSION_SNIPPETS)
    nested = rng.choice(["[1, [2, [3]]]", "[[[]]]", "[1, 2, 3]", "[[1, 2], [3, [4, [5]]]]", "[]"])
    return code(template, a=rng.randint(lo, hi), b=rng.randint(lo, hi), w=rng.choice(WORDS), nested=nested)


def py_dict_count(rng):
    text = rng.choice(SENTENCE_WORDS)
    tail = rng.choice([
        "print(max(counts, key=counts.get))",
        "print(sorted(counts.items(), key=lambda kv: -kv[1])[:3])",
        "print({w: c for w, c in counts.items() if c > 1})",
        "print(len(counts), sum(counts.values()))",
    ])
    return code("""
        text = {text!r}
        counts = {{}}
        for word in text.split():
            counts[word] = counts.get(word, 0) + 1
        {tail}
        """, text=text, tail=tail)


def py_class(rng):
    kind = rng.randrange(4)
    a, b, c = rng.randint(1, 20), rng.randint(1, 9), rng.randint(1, 9)
    if kind == 0:
        return code("""
            class Counter:
                def __init__(self, start=0):
                    self.value = start

                def increment(self, step=1):
                    self.value += step
                    return self

            c = Counter({a})
            c.increment().increment({b})
            print(c.value)
            """, a=a, b=b)
    if kind == 1:
        return code("""
            class Account:
                def __init__(self, balance):
                    self.balance = balance

                def withdraw(self, amount):
                    if amount > self.balance:
                        print('declined')
                        return False
                    self.balance -= amount
                    return True

            acct = Account({a})
            acct.withdraw({b})
            acct.withdraw({c})
            print(acct.balance)
            """, a=a * 10, b=b * 10, c=c * 15)
    if kind == 2:
        animal, sound = rng.choice([("Dog", "Woof"), ("Cat", "Meow"), ("Cow", "Moo"), ("Duck", "Quack")])
        return code("""
            class Animal:
                def speak(self):
                    return '...'

                def greet(self):
                    return f'{{type(self).__name__}} says {{self.speak()}}'

            class {animal}(Animal):
                def speak(self):
                    return '{sound}'

            for pet in [Animal(), {animal}()]:
                print(pet.greet())
            """, animal=animal, sound=sound)
    item1, item2 = rng.sample(FRUITS, 2)
    return code("""
        class Basket:
            items = []

            def add(self, item):
                self.items.append(item)

        a = Basket()
        b = Basket()
        a.add({item1!r})
        b.add({item2!r})
        print(a.items, b.items)
        """, item1=item1, item2=item2)


def py_sorting(rng):
    names = rng.sample(NAMES + FRUITS, rng.randint(4, 7))
    key = rng.choice(["key=len", "key=lambda s: s[-1]", "reverse=True", "key=str.lower", "key=lambda s: (len(s), s)"])
    return f"names = {names}\nprint(sorted(names, {key}))\nprint(names)"


def py_zip_enumerate(rng):
    names = rng.sample(NAMES, 4)
    scores = [rng.randint(40, 100) for _ in names]
    return code("""
        names = {names}
        scores = {scores}
        for i, (name, score) in enumerate(zip(names, scores), start=1):
            if score >= {t}:
                print(i, name)
        """, names=names, scores=scores, t=rng.randint(55, 85))


def py_slicing(rng):
    a, b = rng.randint(0, 5), rng.randint(10, 20)
    slices = some(rng, ["[::2]", "[-3:]", "[1:-1:3]", "[::-1]", "[2:5]", "[:4]", "[::-2]"], 2, 3)
    return "\n".join([f"items = list(range({a}, {b}))"] + [f"print(items{s})" for s in slices])


def py_sets(rng):
    a, b = sorted(rng.sample(range(1, 12), 5)), sorted(rng.sample(range(1, 12), 5))
    ops = some(rng, ["a & b", "a | b", "a - b", "b - a", "a ^ b", "len(a | b)"], 2, 4)
    return "\n".join([f"a = {set(a)}", f"b = {set(b)}"] + [f"print({op})" for op in ops])


def py_scope(rng):
    a, b, c = rng.sample(range(1, 50), 3)
    return code("""
        x = {a}

        def change():
            x = {b}
            return x

        def change_global():
            global x
            x = {c}

        print(change(), x)
        change_global()
        print(x)
        """, a=a, b=b, c=c)


def py_try_except(rng):
    return code("""
        values = {values}
        total = 0
        for v in values:
            try:
                total += int(v)
            except ValueError:
                print('skipping', repr(v))
        print(total)
        """, values=rng.sample(["3", "x", "7", "", "12", "4.5", "-2", "ten", "0"], 5))


def py_generator(rng):
    kind = rng.randrange(3)
    n = rng.randint(5, 20)
    if kind == 0:
        return code("""
            def evens(limit):
                n = 0
                while n < limit:
                    yield n
                    n += 2

            print(sum(evens({n})))
            """, n=n)
    if kind == 1:
        return f"squares = (i * i for i in range({n}))\nprint(next(squares), next(squares))\nprint(sum(squares))"
    return code("""
        def countdown(n):
            while n > 0:
                yield n
                n -= {step}

        print(list(countdown({n})))
        """, step=rng.randint(2, 4), n=n)


def py_pattern(rng):
    n = rng.randint(3, 6)
    return rng.choice([
        f"for i in range(1, {n + 1}):\n    print('*' * i)",
        f"for i in range({n}, 0, -1):\n    print(' ' * ({n} - i) + '#' * i)",
        f"for i in range(1, {n}):\n    print(' '.join(str(i * j) for j in range(1, {n})))",
        f"for row in range({n}):\n    print(''.join('X' if (row + col) % 2 == 0 else 'O' for col in range({n})))",
    ])


def py_closure(rng):
    k, x = rng.randint(2, 9), rng.randint(2, 12)
    template = rng.choice([
        """
        def make_multiplier(k):
            def multiply(x):
                return x * k
            return multiply

        times = make_multiplier({k})
        print(times({x}), times(times(1)))
        """,
        """
        def make_greeter(greeting):
            def greet(name):
                return greeting + ', ' + name + '!'
            return greet

        hello = make_greeter({word!r})
        print(hello({name!r}), hello('world'.upper()))
        """,
        """
        funcs = [lambda x: x + i for i in range(3)]
        print([f({x}) for f in funcs])
        """,
    ])
    return code(template, k=k, x=x, word=rng.choice(["Hello", "Welcome", "Good morning"]), name=rng.choice(NAMES))


def py_map_filter(rng):
    nums = _nums(rng, 1, 20)
    k, m = rng.randint(2, 5), rng.randint(2, 4)
    return f"nums = {nums}\nprint(list(map(lambda x: x * {k}, filter(lambda x: x % {m} == 0, nums))))"


def py_dict_comprehension(rng):
    words = rng.sample(FRUITS + ["kiwifruit", "pineapple", "watermelon"], 5)
    template = rng.choice([
        """
        words = {words}
        lengths = {{w: len(w) for w in words if len(w) > 4}}
        print(lengths)
        """,
        """
        words = {words}
        by_first = {{}}
        for w in words:
            by_first.setdefault(w[0], []).append(w)
        print(by_first)
        """,
        """
        words = {words}
        print({{w[0].upper(): w for w in words}})
        """,
    ])
    return code(template, words=words)


def py_aliasing(rng):
    items = _nums(rng, 1, 9, (3, 4))
    v = rng.randint(10, 99)
    copy = rng.choice(["b = a", "b = a[:]", "b = list(a)", "b = a.copy()", "b = [a, a]"])
    mutate = "b[0].append" if copy == "b = [a, a]" else "b.append"
    return f"a = {items}\n{copy}\n{mutate}({v})\nprint(a)\nprint(b)"


def py_formatting(rng):
    name, price, qty = rng.choice(FRUITS), rng.randint(50, 999) / 100, rng.randint(2, 12)
    return code("""
        name = {name!r}
        price = {price}
        qty = {qty}
        print(f'{{name:<10}}|{{qty:>4}}|{{price * qty:8.2f}}')
        print(f'{{name.upper():*^14}}')
        print(f'{{qty * 1000:,}} grams, {{qty / 3:.3f}} per person')
        """, name=name, price=price, qty=qty)


SQL_TABLES = [
    ("books", ["title", "genre", "pages", "published"], "pages", "genre"),
    ("orders", ["id", "customer_id", "total", "order_date"], "total", "customer_id"),
    ("students", ["name", "class", "score", "enrolled_on"], "score", "class"),
    ("products", ["name", "category", "price", "stock"], "price", "category"),
    ("trips", ["driver", "city", "distance_km", "fare"], "fare", "city"),
]
SQL_QUERIES = [
    """
    SELECT {group}, COUNT(*) AS n, AVG({num}) AS avg_{num}
    FROM {table}
    GROUP BY {group}
    HAVING COUNT(*) >= {n}
    ORDER BY avg_{num} DESC;
    """,
    """
    SELECT {cols}
    FROM {table}
    WHERE {num} > (SELECT AVG({num}) FROM {table})
    ORDER BY {num} DESC
    LIMIT {n};
    """,
    """
    SELECT {group}, MIN({num}) AS lowest, MAX({num}) AS highest, MAX({num}) - MIN({num}) AS spread
    FROM {table}
    GROUP BY {group}
    ORDER BY spread DESC;
    """,
    """
    SELECT t.{group}, SUM(t.{num}) AS total, o.name
    FROM {table} t
    LEFT JOIN {other} o ON o.{group} = t.{group}
    GROUP BY t.{group}, o.name
    ORDER BY total DESC;
    """,
]


def sql_query(rng):
    table, cols, num, group = rng.choice(SQL_TABLES)
    kind = rng.randrange(4)
    n = rng.randint(2, 10)
    other = rng.choice(["regions", "managers", "targets"]) if kind == 3 else ""
    return code(SQL_QUERIES[kind], table=table, cols=", ".join(cols[:2]), num=num, group=group, n=n, other=other)


def js_snippet(rng):
    nums = _nums(rng, 1, 15, (4, 7))
    k = rng.randint(2, 5)
    name, age, words = rng.choice(NAMES), rng.randint(8, 12), rng.sample(FRUITS, 4)
    template = rng.choice([
        """
        const prices = {nums};
        const total = prices.filter(p => p > {k}).reduce((sum, p) => sum + p, 0);
        console.log(total, prices.length);
        """,
        """
        const scores = {nums};
        const [first, second, ...others] = [...scores].sort((a, b) => b - a);
        console.log(first, second, others.length, scores[0]);
        """,
        """
        console.log({k} == '{k}', {k} === '{k}', null == undefined, [] + [], [1, 2] + [3]);
        """,
        """
        const s = '{name}';
        console.log(s.split('').reverse().join(''), s.toUpperCase(), s.includes('a'), s.padStart({age}, '*'));
        """,
        """
        const words = {words};
        const counts = words.reduce((acc, w) => {{
          acc[w.length] = (acc[w.length] || 0) + 1;
          return acc;
        }}, {{}});
        console.log(counts);
        """,
        """
        async function main() {{
          console.log('a');
          await null;
          console.log('b');
        }}
        main();
        console.log('c');
        """,
    ])
    return code(template, nums=nums, k=k, name=name, age=age, words=words)


def shell_snippet(rng):
    ext = rng.choice(["log", "txt", "py", "csv", "tmp"])
    size, count, column = rng.randint(2, 90), rng.randint(3, 10), rng.randint(2, 5)
    return rng.choice([
        f"awk -F, 'NR > 1 {{ total += ${column} }} END {{ print total / (NR - 1) }}' sales.csv",
        f"find . -type f -size +{size}M -exec ls -lh {{}} \\;",
        "grep -c 'ERROR' app.log",
        f"du -sh */ | sort -rh | head -{count}",
        f"for f in *.{ext}; do wc -l \"$f\"; done | sort -n | tail -{count}",
        f"cut -d, -f{column} data.csv | tail -n +2 | sort -u > values.txt",
        f"tar -czf backup-$(date +%F).tar.gz --exclude='*.{ext}' project/",
        f"ps aux --sort=-%mem | head -n {count + 1}",
        f"sed -i 's/colour/color/g' *.{ext}",
        f"ls -1 *.{ext} | wc -l && df -h . | tail -n 1 | awk '{{print $5}}'",
    ])


C_SNIPPETS = [
    """
    #include <stdio.h>

    int main(void) {{
        int a[] = {{{nums}}};
        int *p = a;
        int sum = 0;
        for (int i = 0; i < {count}; i += {step}) {{
            sum += *(p + i);
        }}
        printf("%d\\n", sum);
        return 0;
    }}
    """,
    """
    #include <stdio.h>

    void bump(int x, int *y) {{
        x += {step};
        *y += {step};
    }}

    int main(void) {{
        int a = {first}, b = {second};
        bump(a, &b);
        printf("%d %d\\n", a, b);
        return 0;
    }}
    """,
    """
    #include <stdio.h>

    int main(void) {{
        char s[] = "{word}";
        int n = 0;
        while (s[n] != '\\0') n++;
        for (int i = n - 1; i >= 0; i -= {step}) putchar(s[i]);
        putchar('\\n');
        return 0;
    }}
    """,
]


def c_snippet(rng):
    nums = _nums(rng, 1, 20, (5, 7))
    step = rng.randint(1, 3)
    word = rng.choice(WORDS[:12])
    return code(rng.choice(C_SNIPPETS), nums=", ".join(map(str, nums)), count=len(nums), step=step,
                first=nums[0], second=nums[1], word=word)


PY_SNIPPETS = [py_comprehension, py_loop_accumulate, py_while, py_string_ops, py_recursion, py_dict_count, py_class,
               py_sorting, py_zip_enumerate, py_slicing, py_sets, py_scope, py_try_except, py_generator,
               py_pattern, py_closure, py_map_filter, py_dict_comprehension, py_aliasing, py_formatting]
LANG_NAMES = {"python": "Python", "sql": "SQL", "javascript": "JavaScript", "bash": "shell", "c": "C"}
EXPLAIN_QUESTIONS = [
    "What does this {L} code print?",
    "What will this print, and why?",
    "Explain what this {L} snippet does, line by line.",
    "I'm learning {L}. Can you explain what this code does and what it outputs?",
    "Trace through this code step by step and tell me the final output.",
    "Can you explain this code to a beginner?",
    "What is the output of the following code? Walk me through how you got it.",
    "My teacher gave us this snippet. What does it do?",
    "Explain this code, then suggest how it could be written more clearly.",
    "Describe what each line of this code does.",
    "What is the purpose of this code, and what would it output?",
    "Predict the output of this program and explain your reasoning.",
    "I don't understand this {L} code. What's going on here?",
    "Could you break down this code for me and point out anything surprising about it?",
]
SQL_QUESTIONS = [
    "What does this SQL query return? Explain each clause.",
    "Explain this query in plain English.",
    "Can you walk me through what this SQL does, step by step?",
    "My colleague wrote this query. What does it compute, and are there any pitfalls?",
    "Explain what this query does and what one row of its result means.",
]
SHELL_QUESTIONS = [
    "Explain what this shell command does, piece by piece.",
    "What does this command do? Is it safe to run?",
    "I found this command in a tutorial. Can you explain each part?",
    "Break down this Bash one-liner for me.",
]


def _explain(rng, lang: str, snippet: str, questions: list[str]) -> str:
    """A question about the snippet, usually before it and sometimes after it."""
    question = rng.choice(questions).format(L=LANG_NAMES[lang])
    block = fenced(lang, snippet)
    if rng.random() < 0.25:
        return f"{block}\n\n{question}"
    return f"{question}\n\n{block}"


def _explain_python(snippet: Callable[[random.Random], str]) -> Family:
    def make(rng):
        return _explain(rng, "python", snippet(rng), EXPLAIN_QUESTIONS)
    return make


for _snippet in PY_SNIPPETS:
    family("code_explanation", "python-" + _snippet.__name__.removeprefix("py_").replace("_", "-"),
           weight=0.35)(_explain_python(_snippet))


@family("code_explanation", "sql-query")
def explain_sql(rng):
    return _explain(rng, "sql", sql_query(rng), SQL_QUESTIONS)


@family("code_explanation", "javascript-snippet")
def explain_js(rng):
    return _explain(rng, "javascript", js_snippet(rng), EXPLAIN_QUESTIONS)


@family("code_explanation", "shell-command", weight=0.5)
def explain_shell(rng):
    return _explain(rng, "bash", shell_snippet(rng), SHELL_QUESTIONS)


@family("code_explanation", "c-snippet", weight=0.5)
def explain_c(rng):
    return _explain(rng, "c", c_snippet(rng), EXPLAIN_QUESTIONS)


# =========================================================================================== math_word
def money(cur: str, amount: float) -> str:
    return f"{cur}{amount:,.2f}" if amount != int(amount) else f"{cur}{int(amount):,}"


def mw_change(rng):
    name, he, _, _ = person(rng)
    cur = rng.choice(["$", "£", "€"])
    items = rng.choice(["bread rolls", "sandwiches", "tickets", "coffees", "packs of stickers", "candles"])
    n, price = rng.randint(2, 6), rng.randint(105, 650) / 100
    extra = rng.choice(["a newspaper", "a magazine", "a bottle of water", "a bag"])
    extra_price = rng.randint(50, 400) / 100
    total = n * price + extra_price
    bill = next(b for b in (5, 10, 20, 50, 100) if b > total)
    return rng.choice([
        f"{name} buys {n} {items} that cost {money(cur, price)} each and {extra} for {money(cur, extra_price)}. "
        f"{he.capitalize()} pays with a {money(cur, bill)} note. How much change should {he} get?",
        f"At the shop, {n} {items} cost {money(cur, price)} each. {name} also picks up {extra} for "
        f"{money(cur, extra_price)} and hands over {money(cur, bill)}. What change does {he} receive?",
    ])


def mw_discount(rng):
    cur = rng.choice(["$", "£", "€"])
    thing = rng.choice(["jacket", "bike", "lamp", "pair of boots", "laptop bag", "desk chair", "tent", "blender"])
    price = rng.choice([40, 48, 60, 75, 80, 90, 120, 150, 180, 240, 320])
    off = rng.choice([10, 15, 20, 25, 30, 40])
    tax = rng.choice([5, 8, 10, 20])
    return rng.choice([
        f"A {thing} costs {money(cur, price)} and is on sale for {off}% off. What is the sale price?",
        f"A {thing} normally costs {money(cur, price)}. It is discounted by {off}%, and then a {tax}% sales tax is "
        "added to the discounted price. What is the final price?",
        f"The price of a {thing} went from {money(cur, price)} to {money(cur, price * (100 - off) / 100)}. By what "
        "percentage was it reduced?",
        f"A store takes {off}% off a {money(cur, price)} {thing}, and a coupon takes off another "
        f"{money(cur, rng.randint(3, 10))}. How much does the {thing} cost in the end, and what percentage of the "
        "original price is that?",
    ])


def mw_speed(rng):
    name, he, _, his = person(rng)
    v, t = rng.randint(4, 24) * 5, rng.choice([1.5, 2, 2.5, 3, 4, 0.75])
    d1, d2, v1, v2 = rng.randint(20, 90), rng.randint(20, 90), rng.randint(6, 16) * 5, rng.randint(6, 16) * 5
    unit = rng.choice(["km", "miles"])
    speed = "km/h" if unit == "km" else "mph"
    return rng.choice([
        f"A train travels at {v} {speed} for {t} hours. How far does it go?",
        f"{name} drives {v * 3} {unit} at an average speed of {v} {speed}. If {he} leaves at 9:15 a.m., when does {he} "
        "arrive?",
        f"{name} cycles {d1} {unit} at {v1 // 3} {speed} and then another {d2} {unit} at {v2 // 3} {speed}. What is "
        f"{his} average speed for the whole trip?",
        f"Two cars start from towns {d1 + d2 + 100} {unit} apart and drive towards each other at {v1} {speed} and {v2} "
        f"{speed}. How long until they meet?",
        f"A runner keeps a pace of {rng.randint(4, 7)} minutes per kilometre. How long will a "
        f"{rng.choice([5, 10, 21])} km run take, in hours and minutes?",
    ])


def mw_work_rate(rng):
    a, b = rng.sample([2, 3, 4, 5, 6, 8, 10, 12], 2)
    thing = rng.choice([("pipe", "fill a tank"), ("painter", "paint a fence"), ("printer", "print a batch of flyers"),
                        ("pump", "empty a pool"), ("gardener", "mow a field")])
    return rng.choice([
        f"One {thing[0]} can {thing[1]} in {a} hours and another can do it in {b} hours. How long will it take if they "
        "work together?",
        f"Working alone, a {thing[0]} takes {a} hours to {thing[1]}. With a second {thing[0]} helping, the job takes "
        f"{round(a * b / (a + b), 2)} hours. How long would the second {thing[0]} take alone?",
    ])


def mw_mixing(rng):
    a, b = rng.sample(range(1, 6), 2)
    total = (a + b) * rng.randint(2, 12)
    return rng.choice([
        f"Green paint is made by mixing blue and yellow paint in the ratio {a}:{b}. How much of each is needed for "
        f"{total} litres of green paint?",
        f"A plant fertiliser must be diluted at {a * 5} ml per litre of water. How much fertiliser goes into a "
        f"{total // 2 + 3}-litre watering can, and how many cans does a {a * 250} ml bottle make?",
        f"A concrete mix uses cement, sand and gravel in the ratio 1:{a}:{a + b}. How many buckets of sand and of "
        f"gravel go with {b + 2} buckets of cement, and how many buckets is that in total?",
    ])


def mw_ages(rng):
    (a, _, _, _), (b, _, _, _) = person(rng), person(rng)
    if a == b:
        b = "her cousin"
    x, y, k = rng.randint(5, 40), rng.randint(2, 30), rng.randint(2, 10)
    return rng.choice([
        f"{a} is {y} years older than {b}. In {k} years, the sum of their ages will be {2 * x + y + 2 * k}. How old is "
        f"{b} now?",
        f"{a} is three times as old as {b}. In {k * 2} years {a} will be twice as old as {b}. How old are they now?",
        f"Five years ago, {a} was {x} years old. How old will {a} be in {k} years?",
        f"The ages of {a} and {b} add up to {2 * x + y}, and {a} is {y} years older. Find both ages.",
    ])


def mw_average(rng):
    name, he, _, his = person(rng)
    scores = [rng.randint(60, 98) for _ in range(rng.randint(3, 5))]
    target = rng.choice([80, 85, 88, 90])
    return rng.choice([
        f"{name} scored {', '.join(map(str, scores[:-1]))} and {scores[-1]} on {his} tests. What is {his} average "
        "score?",
        f"{name}'s test scores so far are {', '.join(map(str, scores))}. What does {he} need on the next test to bring "
        f"{his} average up to {target}?",
        f"The average of {len(scores)} numbers is {sum(scores) // len(scores)}. When one more number is added, the "
        f"average becomes {sum(scores) // len(scores) + 2}. What number was added?",
    ])


def mw_area(rng):
    l, w = rng.randint(4, 30), rng.randint(3, 20)
    cur = rng.choice(["$", "£", "€"])
    return rng.choice([
        f"A school playground is {l} metres long and {w} metres wide. How much fencing is needed to go around it, and "
        f"what would it cost at {money(cur, rng.randint(8, 25))} per metre?",
        f"A room measures {l} m by {w} m. Carpet costs {money(cur, rng.randint(12, 40))} per square metre. How much "
        "will it cost to carpet the room?",
        f"I want to paint a wall that is {l // 2 + 2} m wide and {rng.randint(2, 3)}.{rng.randint(1, 9)} m high. One "
        f"tin of paint covers {rng.randint(8, 14)} square metres and I need two coats. How many tins should I buy?",
        f"A square patio has a perimeter of {4 * w} metres. What is its area?",
        f"A circular pond has a radius of {w // 2 + 1} metres. What is its area and its circumference? Use pi = 3.14.",
        f"How many square tiles of side {rng.choice([20, 25, 40, 50])} cm are needed to cover a floor {l // 3 + 2} m "
        f"by {w // 3 + 2} m?",
    ])


def mw_savings(rng):
    name, he, _, _ = person(rng)
    cur = rng.choice(["$", "£", "€"])
    thing = rng.choice(["a new phone", "a bike", "a games console", "concert tickets", "a laptop", "a guitar"])
    per, cost, have = rng.randint(5, 40), rng.randint(120, 900), rng.randint(0, 100)
    return rng.choice([
        f"{name} wants to buy {thing} that costs {money(cur, cost)}. {he.capitalize()} already has {money(cur, have)} "
        f"and saves {money(cur, per)} a week. How many weeks until {he} can afford it?",
        f"{name} earns {money(cur, per * 3)} a week from a paper round and spends a third of it. How much does {he} "
        "save in a year?",
        f"{name} puts {money(cur, per * 10)} into a savings account each month. After {rng.randint(6, 24)} months, how "
        f"much has {he} saved, not counting interest?",
    ])


def mw_fuel(rng):
    cur = rng.choice(["$", "£", "€"])
    use, dist, price = rng.randint(45, 90) / 10, rng.randint(120, 900), rng.randint(140, 210) / 100
    return rng.choice([
        f"My car uses {use} litres of fuel per 100 km. How much fuel do I need for a {dist} km trip, and what will it "
        f"cost if fuel is {money(cur, price)} per litre?",
        f"A van travels {rng.randint(8, 15)} km on one litre of diesel. How many litres does it need for a round trip "
        f"of {dist} km each way?",
    ])


def mw_time(rng):
    h, m, dur = rng.randint(6, 11), rng.choice([0, 5, 15, 20, 35, 40, 50]), rng.randint(35, 250)
    h2, m2 = rng.randint(1, 5), rng.choice([10, 25, 30, 45, 55])
    name, he, _, _ = person(rng)
    return rng.choice([
        f"A film starts at {h}:{m:02d} p.m. and lasts {dur} minutes. What time does it end?",
        f"{name}'s flight leaves at {h}:{m:02d} a.m. and lands at {h2}:{m2:02d} p.m. the same day. How long is the "
        "flight?",
        f"{name} starts homework at {h - 2}:{m:02d} p.m. and spends {dur // 5} minutes on each of five subjects with a "
        f"10-minute break between subjects. When does {he} finish?",
        f"If today is {rng.choice(WEEKDAYS)}, what day of the week will it be in {rng.randint(20, 400)} days?",
    ])


def mw_bill(rng):
    cur = rng.choice(["$", "£", "€"])
    total, people, tip = rng.randint(4000, 30000) / 100, rng.randint(3, 9), rng.choice([10, 12, 15, 18, 20])
    return rng.choice([
        f"Our dinner bill is {money(cur, total)} and we want to leave a {tip}% tip. If {people} of us split it "
        "equally, how much does each person pay?",
        f"{people} friends share a taxi that costs {money(cur, total / 3)} plus a {tip}% tip. How much does each pay?",
        f"A group of {people} orders {people * 2 - 1} pizzas at {money(cur, rng.randint(9, 16))} each and adds a "
        f"{tip}% tip. What is the total, and what is each person's share?",
    ])


def mw_interest(rng):
    cur = rng.choice(["$", "£", "€"])
    p, r, t = rng.choice([500, 1000, 1500, 2000, 2500, 5000, 8000]), rng.choice([2, 3, 4, 5, 6]), rng.randint(2, 6)
    return rng.choice([
        f"How much simple interest does {money(cur, p)} earn at {r}% per year over {t} years?",
        f"I invest {money(cur, p)} at {r}% interest compounded yearly. How much will I have after {t} years?",
        f"A loan of {money(cur, p)} charges {r}% simple interest per year. What is the total to repay after {t} years?",
    ])


def mw_ratio(rng):
    (a, _, _, _), (b, _, _, _) = person(rng), person(rng)
    if a == b:
        b = "a friend"
    cur = rng.choice(["$", "£", "€"])
    x, y = rng.sample(range(1, 8), 2)
    total = (x + y) * rng.randint(5, 60)
    return rng.choice([
        f"{a} and {b} share {money(cur, total)} in the ratio {x}:{y}. How much does each get?",
        f"A drink is made by mixing juice and water in the ratio {x}:{y}. How much juice is in {total * 10} ml of the "
        "drink?",
        f"In a class, the ratio of boys to girls is {x}:{y}. If there are {total // (x + y) * y} girls, how many "
        "pupils are there in total?",
    ])


def mw_reading(rng):
    name, he, _, _ = person(rng)
    pages, per, read = rng.randint(180, 600), rng.randint(12, 45), rng.randint(20, 100)
    return rng.choice([
        f"{name}'s book has {pages} pages. {he.capitalize()} has read {read} pages and reads {per} pages a day. How "
        "many more days will it take to finish?",
        f"{name} reads {per} pages on weekdays and {per * 2} pages on weekend days. How many pages does {he} read in "
        "three weeks?",
    ])


def mw_groups(rng):
    n, cap = rng.randint(60, 400), rng.choice([12, 15, 24, 30, 45, 52])
    return rng.choice([
        f"{n} students are going on a school trip. Each bus holds {cap} students. How many buses are needed, and how "
        "many empty seats will there be?",
        f"A hall has rows of {cap // 2 + 4} chairs. How many full rows are needed to seat {n} guests, and how many "
        "guests sit in the last row?",
        f"Eggs are packed in boxes of {rng.choice([6, 10, 12])}. A farm collects {n} eggs. How many full boxes can be "
        "filled, and how many eggs are left over?",
    ])


def mw_fence(rng):
    length, gap = rng.randint(4, 30) * rng.choice([2, 3, 5]), rng.choice([2, 3, 5])
    return rng.choice([
        f"A straight fence is {length} m long with posts every {gap} m, including one at each end. How many posts are "
        "there?",
        f"Trees are planted every {gap} metres along both sides of a {length} m path, with a tree at each end of each "
        "side. How many trees are planted?",
    ])


def mw_percent_parts(rng):
    n = rng.choice([24, 30, 36, 40, 48, 60, 120, 200])
    p = rng.choice([25, 30, 40, 50, 60, 75])
    return rng.choice([
        f"In a class of {n} students, {p}% walk to school and a third of the rest come by bike. How many come by bike?",
        f"A survey of {n * 10} people found that {p}% prefer tea. Of those, half take it with milk. How many people "
        "prefer tea with milk?",
        f"A shop had {n * 5} umbrellas. It sold {p}% in the first week and {p // 2}% of the remainder in the second "
        "week. How many umbrellas are left?",
    ])


def mw_probability(rng):
    r, b, g = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 6)
    return rng.choice([
        f"A bag holds {r} red, {b} blue and {g} green marbles. If I pick one at random, what is the probability it is "
        "blue?",
        f"A bag holds {r} red and {b} blue marbles. Two are drawn without replacement. What is the probability that "
        "both are red?",
        f"Two fair dice are rolled. What is the probability that the total is {rng.randint(4, 10)}?",
        f"A spinner has {r + b} equal sections, {r} of them red. If it is spun twice, what is the probability of "
        "getting red both times?",
    ])


def mw_pay(rng):
    name, he, _, _ = person(rng)
    cur = rng.choice(["$", "£", "€"])
    rate, hours = rng.randint(12, 30), rng.randint(41, 55)
    return rng.choice([
        f"{name} earns {money(cur, rate)} an hour and gets time and a half for every hour over 40 in a week. Last week "
        f"{he} worked {hours} hours. How much did {he} earn?",
        f"A tutor charges {money(cur, rate * 2)} per hour. If {he} teaches {rng.randint(8, 20)} hours a week for "
        f"{rng.randint(4, 12)} weeks, how much does {he} earn?",
    ])


def mw_growth(rng):
    pop, g = rng.randint(8, 90) * 1000, rng.choice([2, 3, 4, 5, 8, 10])
    return rng.choice([
        f"A town has {pop:,} people and its population grows by {g}% each year. About how many people will live there "
        "in two years?",
        f"A phone loses {g * 3}% of its value each year. If it cost {money('$', rng.randint(4, 12) * 100)} new, what "
        "is it worth after three years?",
    ])


def mw_energy(rng):
    watts, hours, price = rng.choice([60, 100, 800, 1200, 2000, 2500]), rng.randint(1, 8), rng.randint(15, 35)
    return (f"An appliance uses {watts} watts and runs for {hours} hours a day. Electricity costs {price} cents per "
            "kWh. How much does it cost to run for 30 days?")


def mw_sports(rng):
    won, games, pct = rng.randint(5, 20), rng.randint(22, 40), rng.choice([60, 70, 75, 80])
    return rng.choice([
        f"A team has won {won} of its first {games // 2 + won // 2} games. There are {games} games in the season. How "
        f"many of the remaining games must it win to finish with at least {pct}% wins?",
        f"A basketball player has made {won} of {won + rng.randint(4, 15)} free throws. What is her success rate as a "
        f"percentage, and how many of her next 10 must she make to reach {pct}%?",
    ])


def mw_unit_price(rng):
    cur = rng.choice(["$", "£", "€"])
    n1, n2 = rng.sample([4, 6, 8, 10, 12, 18, 24], 2)
    p1, p2 = n1 * rng.randint(30, 90) / 100, n2 * rng.randint(30, 90) / 100
    item = rng.choice(["yoghurts", "batteries", "bottles of water", "rolls of kitchen paper", "cans of soup"])
    return (f"A pack of {n1} {item} costs {money(cur, round(p1, 2))} and a pack of {n2} costs "
            f"{money(cur, round(p2, 2))}. Which is the better deal per item?")


def mw_exchange(rng):
    one, many, target, rate = rng.choice([("euro", "euros", "US dollars", 1.08), ("pound", "pounds", "euros", 1.17),
                                          ("US dollar", "US dollars", "Japanese yen", 150),
                                          ("Canadian dollar", "Canadian dollars", "euros", 0.68)])
    amount = rng.randint(5, 80) * 10
    return rng.choice([
        f"If one {one} is worth {rate} {target}, how many {target} do I get for {amount} {many}?",
        f"The exchange rate is {rate} {target} per {one}. An exchange office charges a 3% fee. How many {target} will "
        f"I receive for {amount} {many}?",
    ])


def mw_consecutive(rng):
    k = rng.randint(10, 90)
    m = rng.randint(2, 6)
    return rng.choice([
        f"The sum of three consecutive integers is {3 * k + 3}. What are the integers?",
        f"The sum of two consecutive even numbers is {4 * k + 2}. What are they?",
        f"I think of a number, multiply it by {m} and add {k}. The result is {k + m * rng.randint(3, 40)}. What was my "
        "number?",
    ])


def mw_coins(rng):
    q, d, n = rng.randint(2, 15), rng.randint(2, 20), rng.randint(1, 12)
    return rng.choice([
        f"A jar contains {q} quarters, {d} dimes and {n} nickels. How much money is in the jar?",
        f"I have {q + d} coins, all 10p and 20p coins, worth {q * 20 + d * 10}p in total. How many of each coin do I "
        "have?",
    ])


def mw_cooking(rng):
    kg = rng.randint(12, 30) / 10
    return rng.choice([
        f"A roast needs 20 minutes per 500 g plus an extra 20 minutes. How long should a {kg} kg roast cook, and if I "
        "want to eat at 7 p.m. and let it rest for 15 minutes, when should it go in the oven?",
        f"Rice needs {rng.randint(12, 20)} minutes to cook and the vegetables need {rng.randint(5, 10)}. If dinner "
        "should be ready at 6:30 p.m., when should each go on the stove?",
    ])


def mw_tank(rng):
    v, f, leak = rng.randint(2, 12) * 100, rng.randint(20, 60), rng.randint(5, 15)
    return (f"A tank holds {v} litres. A tap fills it at {f} litres per minute, but a leak loses {leak} litres per "
            "minute. How long does it take to fill the empty tank?")


MATH_SCENARIOS = [mw_change, mw_discount, mw_speed, mw_work_rate, mw_mixing, mw_ages, mw_average, mw_area, mw_savings,
                  mw_fuel, mw_time, mw_bill, mw_interest, mw_ratio, mw_reading, mw_groups, mw_fence, mw_percent_parts,
                  mw_probability, mw_pay, mw_growth, mw_energy, mw_sports, mw_unit_price, mw_exchange, mw_consecutive,
                  mw_coins, mw_cooking, mw_tank]
MATH_FRAMES = ["{q}", "{q}", "{q}", "Can you help me solve this? {q}", "My son's homework question: {q}",
               "Here's a word problem I'm stuck on. {q}", "Quick maths question: {q}", "Solve this word problem: {q}",
               "Please solve the following problem.\n\n{q}", "I'm revising for a maths test. {q}"]
MATH_SUFFIXES = ["", "", "Show your work.", "Explain each step.", "Please explain your reasoning step by step.",
                 "Give the final answer at the end.", "Show the calculation.",
                 "Explain it so a 12-year-old could follow.",
                 "Check your answer at the end."]


def _framed_word_problem(scenario: Family) -> Family:
    def make(rng):
        return sentences(rng.choice(MATH_FRAMES).format(q=scenario(rng)), rng.choice(MATH_SUFFIXES))
    return make


for _scenario in MATH_SCENARIOS:
    family("math_word", _scenario.__name__.removeprefix("mw_").replace("_", "-"))(_framed_word_problem(_scenario))


# ======================================================================================= symbolic_math
def term(c: int, power: int, var: str) -> str:
    """|c| var^power, with the 1s and ^1 left out."""
    body = "" if power == 0 else var if power == 1 else f"{var}^{power}"
    return (str(abs(c)) if abs(c) != 1 or power == 0 else "") + body


def poly(coeffs: list[int], var: str = "x") -> str:
    """A polynomial from its coefficients, highest degree first: poly([2, -3, 0, 1]) == '2x^3 - 3x^2 + 1'."""
    out = ""
    degree = len(coeffs) - 1
    for i, c in enumerate(coeffs):
        if c == 0:
            continue
        t = term(c, degree - i, var)
        out = ("-" if c < 0 else "") + t if not out else out + (" - " if c < 0 else " + ") + t
    return out or "0"


def plus(c: int, var: str) -> str:
    """A nonzero term c*var to append to an expression: ' + 3y', ' - y'."""
    return (" - " if c < 0 else " + ") + term(c, 1, var)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def kx(k: int, var: str = "x") -> str:
    return poly([k, 0], var)


def nonzero(rng: random.Random, lo: int, hi: int) -> int:
    return rng.choice([v for v in range(lo, hi + 1) if v != 0])


def random_poly(rng: random.Random, degree: int) -> list[int]:
    return [nonzero(rng, -9, 9)] + [rng.randint(-9, 9) for _ in range(degree)]


def quadratic_from_roots(k: int, r1: int, r2: int) -> list[int]:
    return [k, -k * (r1 + r2), k * r1 * r2]


MATH_VARS = ["x", "x", "x", "y", "t", "n", "a"]
SYM_SUFFIXES = ["", "", "Show your steps.", "Explain each step.", "Please show all the working.",
                "Check your answer.", "Explain the method as you go."]


def sym(rng: random.Random, text: str) -> str:
    """The task with a random request for working; after a line break when the task spans lines."""
    suffix = rng.choice(SYM_SUFFIXES)
    return f"{text}\n{suffix}" if suffix and "\n" in text else sentences(text, suffix)


@family("symbolic_math", "linear-equation")
def sym_linear(rng):
    v = rng.choice(MATH_VARS)
    x0, a, b = rng.randint(-12, 12), nonzero(rng, -9, 9), rng.randint(-20, 20)
    c = rng.choice([w for w in range(-9, 10) if w != a])
    if rng.random() < 0.5:
        eq = f"{poly([a, b], v)} = {poly([c, (a - c) * x0 + b], v)}"
    else:
        p, q = nonzero(rng, -9, 9), nonzero(rng, -6, 6)
        eq = f"{a}({poly([1, p], v)}) = {poly([q, a * (x0 + p) - q * x0], v)}"
    return sym(rng, rng.choice([f"Solve for {v}: {eq}.", f"Solve {eq}.", f"Find the value of {v} that satisfies {eq}.",
                                f"What is {v} if {eq}?", f"Solve the equation {eq} and check your answer."]))


@family("symbolic_math", "quadratic-equation")
def sym_quadratic(rng):
    if rng.random() < 0.7:
        r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
        q = poly(quadratic_from_roots(rng.choice([1, 1, 1, 2, 3, -1]), r1, r2))
    else:
        a, b, c = rng.randint(1, 4), rng.randint(-9, 9), rng.randint(-9, 9)
        while b * b - 4 * a * c <= 0 or int((b * b - 4 * a * c) ** 0.5) ** 2 == b * b - 4 * a * c:
            c -= 1
        q = poly([a, b, c])
    return sym(rng, rng.choice([f"Solve {q} = 0.", f"Find the roots of {q}.", f"Solve {q} = 0 by factoring if you can.",
                                f"Use the quadratic formula to solve {q} = 0.",
                                f"For which values of x is {q} equal to zero?",
                                f"Solve {q} = 0 and give exact answers.", "Find the x-intercepts of the parabola y = "
                                                                          f"{q}."]))


@family("symbolic_math", "factor")
def sym_factor(rng):
    kind = rng.randrange(4)
    if kind == 0:
        e = poly(quadratic_from_roots(rng.choice([1, 1, 2, 3, 5]), rng.randint(-9, 9), rng.randint(-9, 9)))
    elif kind == 1:
        a, b, c, d = rng.randint(2, 5), nonzero(rng, -7, 7), rng.randint(1, 4), nonzero(rng, -7, 7)
        e = poly([a * c, a * d + b * c, b * d])
    elif kind == 2:
        a, b = rng.randint(1, 7), rng.randint(1, 9)
        e = poly([a * a, 0, -b * b]) if rng.random() < 0.6 else f"{poly([a * a, 0, 0], 'x')} - {term(b * b, 2, 'y')}"
    else:
        r1, r2, k = rng.randint(-6, 6), rng.randint(-6, 6), rng.choice([1, 2, 3])
        e = poly(quadratic_from_roots(k, r1, r2) + [0])
    return sym(rng, rng.choice([f"Factor {e} completely.", f"Factorise {e}.", f"How do I factor {e}?",
                                f"Write {e} as a product of factors."]))


@family("symbolic_math", "expand")
def sym_expand(rng):
    a, b, c, d = nonzero(rng, -5, 5), nonzero(rng, -9, 9), nonzero(rng, -5, 5), nonzero(rng, -9, 9)
    e = rng.choice([f"({poly([a, b])})({poly([c, d])})", f"({poly([a, b])})^2", f"({poly([1, b])})^3",
                    f"({poly([a, b])})({poly([1, c, d])})",
                    f"{abs(a) + 1}({poly([1, b])}) - {abs(c) + 1}({poly([1, d])})",
                    f"({poly([1, b])})({poly([1, -b])})", f"({poly([a, 0])}{plus(b, 'y')})^2"])
    return sym(rng, rng.choice([f"Expand and simplify {e}.", f"Expand {e}.",
                                f"Multiply out {e} and collect like terms."]))


def derivative_target(rng: random.Random) -> str:
    k, n, a, b = nonzero(rng, -5, 6), rng.randint(2, 6), rng.randint(1, 9), nonzero(rng, -9, 9)
    return rng.choice([
        poly(random_poly(rng, rng.randint(2, 4))), f"x^{n} sin({kx(k)})", f"e^({kx(k)}) cos(x)",
        f"({poly([a, b])})^{n}", f"ln({poly([a, 0, abs(b)])})", f"sqrt({poly([a, abs(b)])})",
        f"({poly([a, b])})/({poly([1, -b])})", f"x^{n} e^({kx(k)})", f"sin({kx(k)})^2", f"tan({kx(k)})",
        f"{a}/x^{n}", "x ln(x)", "e^(x^2)", f"cos({poly([a, 0, b])})", f"({poly([1, b])}) e^(-x)", f"arctan({kx(a)})",
    ])


@family("symbolic_math", "derivative", weight=2)
def sym_derivative(rng):
    f = derivative_target(rng)
    if rng.random() < 0.15:
        a, b, c = rng.randint(1, 5), nonzero(rng, -4, 4), rng.randint(5, 40)
        return sym(rng, f"Find dy/dx if {term(a, 2, 'x')}{plus(b, 'xy')} + y^2 = {c}.")
    return sym(rng, rng.choice([
        f"Differentiate f(x) = {f}.", f"Find the derivative of {f} with respect to x.",
        f"What is d/dx of {f}? Say which rules you use.", f"Find f'(x) if f(x) = {f}.",
        f"Compute the derivative of y = {f} and simplify.", f"Find the first and second derivatives of {f}.",
        f"Find the derivative of f(x) = {f} and evaluate it at x = {rng.randint(0, 3)}.",
    ]))


@family("symbolic_math", "integral", weight=2)
def sym_integral(rng):
    k, a, b, n = nonzero(rng, -4, 5), rng.randint(1, 6), nonzero(rng, -9, 9), rng.randint(2, 5)
    p = poly(random_poly(rng, rng.randint(1, 3)))
    lo, hi = rng.randint(-3, 1), rng.randint(2, 5)
    return sym(rng, rng.choice([
        f"Integrate {p} with respect to x.", f"Find the indefinite integral of {p}.",
        f"Evaluate the definite integral of {p} from x = {lo} to x = {hi}.",
        f"Find the area between the curve y = {poly([-1, 0, n * n])} and the x-axis.",
        f"Integrate e^({kx(k)}) dx.", f"Find the integral of sin({kx(k)}) + cos(x).",
        f"Integrate 1/({poly([a, b])}) with respect to x.", f"Use integration by parts to integrate x e^({kx(k)}).",
        f"Use a substitution to integrate x({poly([1, 0, a])})^{n}.", "Integrate x ln(x) dx.",
        f"Find the integral of {a}/({poly([1, 0, a * a])}) dx.", f"Evaluate the integral of x^{n} from 0 to {hi}.",
        f"Integrate ({poly([1, b])})^{n} dx.", f"Find the integral of sqrt({kx(a)}) dx.",
    ]))


@family("symbolic_math", "limit")
def sym_limit(rng):
    a, k, c, d = rng.randint(1, 9), nonzero(rng, -5, 6), rng.randint(1, 7), rng.randint(1, 7)
    b, e = rng.randint(-9, 9), rng.randint(1, 9)
    return sym(rng, rng.choice([
        f"Find the limit of ({poly([1, 0, -a * a])})/({poly([1, -a])}) as x approaches {a}.",
        f"Evaluate lim x->0 of sin({kx(k)})/x.",
        f"Find the limit as x goes to infinity of ({poly([c, b, 1])})/({poly([d, 0, e])}).",
        f"What is lim x->0 of (e^({kx(k)}) - 1)/x?", f"Evaluate the limit of (1 + {a}/x)^x as x goes to infinity.",
        f"Find lim x->{a} of (sqrt(x) - sqrt({a}))/(x - {a}).", f"Evaluate lim x->0 of (1 - cos({kx(k)}))/x^2.",
        f"Does the limit of |x - {a}|/(x - {a}) as x approaches {a} exist? Explain.",
        f"Find the limit as x approaches infinity of sqrt(x^2 + {a}x) - x.",
    ]))


@family("symbolic_math", "system-of-equations")
def sym_system(rng):
    x, y = rng.randint(-8, 8), rng.randint(-8, 8)
    while True:
        a1, b1, a2, b2 = (nonzero(rng, -6, 6) for _ in range(4))
        if a1 * b2 != a2 * b1:
            break
    e1 = f"{poly([a1, 0])}{plus(b1, 'y')} = {a1 * x + b1 * y}"
    e2 = f"{poly([a2, 0])}{plus(b2, 'y')} = {a2 * x + b2 * y}"
    return sym(rng, rng.choice([f"Solve the system of equations {e1} and {e2}.",
                                f"Use elimination to solve:\n{e1}\n{e2}",
                                f"Use substitution to solve the simultaneous equations {e1}, {e2}.",
                                f"Find x and y if {e1} and {e2}."]))


@family("symbolic_math", "inequality")
def sym_inequality(rng):
    a, b, c, d = nonzero(rng, -7, 7), rng.randint(-15, 15), nonzero(rng, -7, 7), rng.randint(-15, 15)
    op = rng.choice(["<", ">", "<=", ">="])
    if a == c:
        c += 1
    q = poly(quadratic_from_roots(1, *sorted(rng.sample(range(-8, 9), 2))))
    return sym(rng, rng.choice([f"Solve the inequality {poly([a, b])} {op} {poly([c, d])}.",
                                f"Solve {q} {op} 0 and write the answer in interval notation.",
                                f"For which real x is {q} {op} 0?",
                                f"Solve |{poly([a, b])}| {rng.choice(['<', '>='])} {rng.randint(1, 12)}."]))


@family("symbolic_math", "rational-expression")
def sym_rational(rng):
    r1, r2, r3 = rng.sample([r for r in range(-8, 9) if r], 3)
    num, den = poly(quadratic_from_roots(1, r1, r2)), poly(quadratic_from_roots(1, r1, r3))
    return sym(rng, rng.choice([f"Simplify ({num})/({den}).",
                                f"Simplify ({num})/({den}) and state any excluded values.",
                                f"Reduce the rational expression ({num}) / ({den}) to lowest terms.",
                                f"Simplify 1/({poly([1, -r1])}) + 1/({poly([1, -r2])}) into a single fraction."]))


@family("symbolic_math", "exponents-logs")
def sym_logs(rng):
    b, k, c, a = rng.choice([2, 3, 5, 10]), rng.randint(2, 6), rng.randint(2, 30), rng.randint(2, 5)
    return sym(rng, rng.choice([
        f"Solve {b}^x = {b ** k}.", f"Solve {b}^(2x - 1) = {b ** (2 * k - 1)}.",
        f"Solve log base {b} of (x + {c}) = {k}.",
        f"Solve e^({kx(a)}) = {c} exactly.", f"Solve {a} * {b}^x = {a * b ** k}.",
        f"Simplify log_{b}({b ** k}) + log_{b}(1/{b}).",
        f"Solve log(x) + log(x - {a * 3}) = log({a * 3 + 10}), checking which solutions are valid.",
        f"Write {a} log(x) - log(y) + {k} log(z) as a single logarithm.",
        f"Simplify (x^{k} y^{a})^{b} / (x^{k + 1} y).",
        f"Simplify ({a}x^{k} y^{b})^2 / ({2 * a}x^{k - 1} y^{b}).", f"Solve {b}^(x + 1) + {b}^x = {(b + 1) * b ** k}.",
    ]))


@family("symbolic_math", "sequence")
def sym_sequence(rng):
    a, d, n, r = rng.randint(-10, 20), nonzero(rng, -6, 9), rng.randint(8, 40), rng.choice([2, 3, -2, 0.5])
    i, j = sorted(rng.sample(range(2, 15), 2))
    return sym(rng, rng.choice([
        f"An arithmetic sequence starts {a}, {a + d}, {a + 2 * d}, ... Find the {ordinal(n)} term and the sum of the "
        f"first {n} terms.",
        f"The {ordinal(i)} term of an arithmetic sequence is {a + (i - 1) * d} and the {ordinal(j)} term is "
        f"{a + (j - 1) * d}. Find the first term and the common difference.",
        f"A geometric sequence has first term {a or 1} and common ratio {r}. Find the {ordinal(n // 4 + 3)} term.",
        f"Find the sum of the infinite geometric series {rng.choice([8, 12, 27, 64])} + ... with common ratio "
        f"{rng.choice(['1/2', '1/3', '-1/2', '2/3'])}.",
        f"Find a formula for the nth term of the sequence {a}, {a + d}, {a + 2 * d}, {a + 3 * d}, ...",
        f"What is the sum 1 + 2 + 3 + ... + {n * 5}? Explain the trick.",
    ]))


@family("symbolic_math", "calculus-application")
def sym_application(rng):
    r1, r2 = rng.sample(range(-5, 6), 2)
    cubic = poly([2, -3 * (r1 + r2), 6 * r1 * r2, rng.randint(-9, 9)])
    f, a = poly(random_poly(rng, rng.randint(2, 3))), rng.randint(-3, 3)
    return sym(rng, rng.choice([
        f"Find and classify the stationary points of y = {cubic}.",
        f"Find the local maximum and minimum of f(x) = {cubic}.",
        f"Find the equation of the tangent line to y = {f} at x = {a}.",
        f"Find the equation of the normal to y = {f} at x = {a}.",
        f"On which intervals is f(x) = {cubic} increasing?", f"Find the inflection point of y = {cubic}.",
    ]))


@family("symbolic_math", "complete-the-square")
def sym_square(rng):
    b, c = rng.randint(-12, 12), rng.randint(-20, 20)
    e = poly([rng.choice([1, 1, 2, 3]), b, c])
    return sym(rng, rng.choice([f"Complete the square for {e}.", f"Write {e} in vertex form and give the vertex.",
                                f"By completing the square, find the minimum value of {e}."]))


@family("symbolic_math", "trigonometry")
def sym_trig(rng):
    eq = rng.choice(["sin(x) = 1/2", "2cos(x) - 1 = 0", "tan(x) = 1", "2sin(x)^2 - sin(x) - 1 = 0", "sin(2x) = cos(x)",
                     "cos(x)^2 = 3/4", "sqrt(3) tan(x) = 1", "2sin(x) + sqrt(2) = 0", "cos(2x) = sin(x)",
                     "sin(x) = cos(x)"])
    interval = rng.choice(["0 <= x < 2pi", "0 <= x < 360 degrees", "-pi <= x <= pi"])
    identity = rng.choice(["sin(x)^2 + cos(x)^2 + tan(x)^2", "(1 - cos(x)^2)/sin(x)", "sin(2x)/(2cos(x))",
                           "cos(x)^4 - sin(x)^4", "sec(x) - sin(x) tan(x)", "(1 - cos(2x))/sin(2x)"])
    return sym(rng, rng.choice([f"Solve {eq} for {interval}.", f"Find all solutions of {eq} with {interval}.",
                                f"Find the general solution of {eq}.", f"Simplify {identity}."]))


@family("symbolic_math", "series")
def sym_series(rng):
    k, n = nonzero(rng, -3, 4), rng.randint(3, 5)
    f = rng.choice([f"e^({kx(k)})", f"sin({kx(k)})", f"cos({kx(k)})", f"ln(1 + {kx(abs(k))})", f"1/(1 - {kx(abs(k))})",
                    "sqrt(1 + x)", "x e^x", "arctan(x)"])
    return sym(rng, rng.choice([f"Find the first {n} nonzero terms of the Maclaurin series of {f}.",
                                f"Write the Taylor series of {f} around x = 0 up to the x^{n} term.",
                                f"Use a Maclaurin series to approximate {f} near x = 0, keeping {n} terms."]))


@family("symbolic_math", "partial-fractions")
def sym_partial(rng):
    r1, r2 = rng.sample(range(-6, 7), 2)
    A, B = nonzero(rng, -5, 5), nonzero(rng, -5, 5)
    num = poly([A + B, -(A * r2 + B * r1)])
    den = poly(quadratic_from_roots(1, r1, r2))
    return sym(rng, rng.choice([f"Decompose ({num})/({den}) into partial fractions.",
                                f"Integrate ({num})/({den}) using partial fractions.",
                                f"Write ({num})/({den}) as a sum of simpler fractions."]))


@family("symbolic_math", "binomial")
def sym_binomial(rng):
    a, b, n = rng.randint(1, 3), nonzero(rng, -4, 4), rng.randint(4, 9)
    return sym(rng, rng.choice([f"Find the coefficient of x^{rng.randint(2, n - 1)} in the expansion of "
                                f"({poly([a, b])})^{n}.",
                                f"Use the binomial theorem to expand ({poly([a, b])})^{min(n, 5)}.",
                                f"Find the constant term in the expansion of (x + {abs(b)}/x)^{2 * (n // 2)}."]))


@family("symbolic_math", "matrix")
def sym_matrix(rng):
    while True:
        a, b, c, d = (rng.randint(-6, 9) for _ in range(4))
        if a * d - b * c != 0:
            break
    m = f"[[{a}, {b}], [{c}, {d}]]"
    return sym(rng, rng.choice([f"Find the determinant and the inverse of the matrix {m}.",
                                f"Find the eigenvalues of the matrix [[{a}, {b}], [{b}, {d}]].",
                                f"Solve the matrix equation {m} X = [[{rng.randint(-9, 9)}], [{rng.randint(-9, 9)}]].",
                                f"Compute {m} squared."]))


PROOFS = ["the sum of the first n odd numbers is n^2", "the square root of 2 is irrational",
          "there are infinitely many prime numbers", "the product of two odd numbers is odd",
          "n^3 - n is divisible by 6 for every integer n", "1 + 2 + ... + n = n(n + 1)/2 by induction",
          "the angles of a triangle add up to 180 degrees", "the derivative of x^2 is 2x from first principles",
          "a number is divisible by 3 exactly when the sum of its digits is", "2^n > n^2 for every integer n >= 5",
          "the sum of any three consecutive integers is divisible by 3", "log(ab) = log(a) + log(b)",
          "the sum of a geometric series a + ar + ... + ar^(n-1) is a(1 - r^n)/(1 - r)",
          "sin(x)^2 + cos(x)^2 = 1 using the unit circle"]


@family("symbolic_math", "proof", weight=0.4)
def sym_proof(rng):
    return rng.choice(["Prove that {p}.", "Show that {p}.", "Can you explain a proof that {p}?",
                       "Give a clear, step-by-step proof that {p}."]).format(p=rng.choice(PROOFS))


# ==================================================================================== creative_writing
CHARACTERS = [
    "a retired ferry captain", "a nervous first-year teacher", "a street-food vendor who remembers every customer",
    "an AI assistant that has started keeping a diary", "a twelve-year-old who can hear what plants are thinking",
    "a night-shift nurse", "a piano tuner who has never once been late", "a washed-up stage magician",
    "a beekeeper in the mountains", "a delivery cyclist in a city of hills", "a grandmother learning to skateboard",
    "a translator who suddenly forgets every language but one", "a ship's cat", "a ghost who wants to learn to cook",
    "a librarian on the last day before the library closes", "a young astronaut on a first mission",
    "a detective who only works on lost-pet cases", "an elderly postman",
    "a robot gardener on an abandoned space station", "a baker who bakes one secret ingredient into every loaf",
    "a teenage chess prodigy", "a bus driver on the last route of the night", "a dragon who collects old postcards",
    "a bored museum guard", "a surveyor measuring a road that keeps getting longer",
    "a bookseller who never sells any books", "a violinist who has never played for an audience",
    "a mail carrier in a snowbound village", "a mountain-rescue volunteer", "a shy inventor",
    "a farmer whose scarecrow comes alive", "a time traveller stuck in a single Tuesday",
    "a court jester who has run out of jokes", "a girl who finds a message in a bottle", "a wedding photographer",
    "a hotel receptionist who knows every guest's secret", "a retired spy running a flower shop",
    "a kid who has to look after the class hamster for the summer",
    "an apprentice bell-ringer who is afraid of heights", "a taxi driver who picks up a passenger with no destination",
    "a scientist who accidentally shrinks to the size of an ant", "an ice-cream seller in a town with no summer",
    "a lonely weather-station robot", "a tailor who sews memories into coats",
    "a firefighter on the last shift before retirement", "a boy who can talk to the moon",
    "a chef who has lost the sense of taste", "an old dog waiting for its owner", "a stranded alien tourist",
    "a tour guide in a city that doesn't exist on any map",
]
SETTINGS = [
    "a sleeper bus crossing the Andes", "a flooded city where people commute by boat", "a small bakery at 4 a.m.",
    "a cargo ship three months from port", "a village where it has rained for a hundred days",
    "a crowded market in Marrakesh", "an empty school during the summer holidays",
    "a weather station on a remote island", "a mountain hut during a storm", "a rooftop garden in a megacity",
    "a desert town with one petrol station", "an underwater hotel", "a forest where the trees whisper at night",
    "a busy hospital corridor", "a space elevator halfway to orbit", "a snowed-in mountain cabin",
    "a Victorian railway station", "a floating city above the clouds", "a run-down cinema on its final night",
    "a travelling circus", "an all-night petrol station", "a lunar mining colony",
    "a fishing village on a remote island", "an airport during a blackout", "a castle that moves every night",
    "a secondhand bookshop with no back wall", "a night bus crossing the city", "a farm on the edge of a volcano",
    "a city where music is forbidden", "a wedding that is going badly wrong", "a summer camp by a lake",
    "a botanical garden after closing time", "a world where the sun rises only once a year",
    "a small-town diner on Christmas Eve", "a ferry in thick fog",
]
CONFLICTS = [
    "must deliver a letter before sunrise", "discovers a secret about their family",
    "has to choose between two friends", "finds a staircase that wasn't there yesterday",
    "wakes up with someone else's memories", "has one day to win back a lost friend",
    "receives a phone call from their future self", "loses the one thing they promised to protect",
    "must convince a whole town of something no one believes", "accidentally becomes famous overnight",
    "is the only one who notices that the stars have moved", "must finish an impossible task before the festival",
    "finds a map hidden inside an old coat", "has to tell the truth for a whole day",
    "meets their childhood hero and is disappointed", "must return a stolen object without getting caught",
    "hears a knock at the door at exactly midnight every night", "tries to fix a mistake and makes it worse",
    "is given a key but not told what it opens", "has to survive a week without any technology",
    "inherits a house full of locked rooms", "must guide a group of strangers home through a storm",
    "realises the town is slowly being forgotten", "keeps receiving letters addressed to someone who died long ago",
    "has to make peace with an old rival",
]
STORY_FORMS = [
    "Write a short story in which {c} {x}. Set it in {s}.",
    "Write the opening paragraph of a story set in {s}, featuring {c}.",
    "Write the opening scene of a novel in which {c} {x}.",
    "Write {genre} story in which {c} {x}.",
    "Write a piece of flash fiction set in {s} in which {c} {x}.",
    "Write the monologue of a character in a play where {c} {x}.",
    "Write a story in which {c} {x}, told by someone watching from a distance.",
    "Write a story in the form of diary entries kept by {c} in {s}.",
    "Describe {s} through the eyes of {c}. Focus on {sense}.",
    "I need a story idea turned into a scene: {c} {x}, in {s}. Please write it.",
    "Write a short story set in {s} that ends with {c} making a difficult decision.",
]
GENRES = ["a mystery", "a science fiction", "a fantasy", "a comedy", "a gentle horror", "a romance", "a fairy-tale",
          "a western", "a thriller", "a magical-realism", "an adventure", "a slice-of-life", "a cosy mystery"]
SENSES = ["sounds and smells", "light and colour", "textures and temperature", "the small details nobody notices",
          "the passing of time", "movement and noise"]
STORY_CONSTRAINTS = [
    "Keep it under 300 words.", "Write it in the present tense.", "Use first-person narration.", "End with a twist.",
    "Give it a hopeful ending.", "Include at least three lines of dialogue.", "Make it funny.",
    "Use vivid sensory details.", "Aim for about 400 words.", "Don't reveal the twist until the last line.",
    "Write it for a ten-year-old reader.", "Use second-person narration.", "Keep the tone melancholy but warm.",
    "Make the setting feel like a character.", "Start in the middle of the action.", "Leave the ending open.",
    "Give the main character a name and a clear goal.",
]
FIRST_LINES = [
    "The last person in the city switched off the lights, and then someone knocked.",
    "Nobody had opened the red door on the fourth floor in thirty years.",
    "On the morning of her hundredth birthday, my grandmother asked me to help her steal a boat.",
    "The bridge had been closed for years, so who had left the fresh footprints?",
    "Every clock in the village stopped at 3:17.",
    "It was the kind of rain that made people tell the truth.",
    "The robot had been polite for eleven years, which is why its first lie surprised everyone.",
    "I found the letter in a library book that hadn't been borrowed since 1962.",
    "The snow started falling upwards at noon.",
    "We were halfway across the lake when the ice began to sing.",
    "My neighbour's garden grows a new statue every night.",
    "The ferry left without the captain.",
    "Grandpa always said the attic was empty, so I never asked about the footsteps.",
    "The first message from the stars was a recipe.",
    "She had exactly one match left and a very long night ahead.",
    "The bakery's bell rang, but nobody came in.",
    "When the power came back on, there was one more chair at the table.",
    "The sign on the shop said 'Closed for repairs', but the shop had never been open.",
    "My brother came home from the war with a parrot and no explanation.",
    "The festival lanterns were supposed to float away; this one came back.",
    "Nobody at the station had ever seen a train arrive from that direction.",
    "The town's only traffic light turned purple.",
]
DIALOGUE_TOPICS = ["who forgot to lock the door", "whether to sell the family farm", "a missing birthday present",
                   "the last slice of cake", "where to spend the holidays", "an old promise", "a mysterious parcel",
                   "who should be the new captain", "a mistake at work", "a map with a missing piece"]


@family("creative_writing", "story-prompt", weight=4)
def creative_story(rng):
    text = rng.choice(STORY_FORMS).format(c=rng.choice(CHARACTERS), s=rng.choice(SETTINGS), x=rng.choice(CONFLICTS),
                                          genre=rng.choice(GENRES), sense=rng.choice(SENSES))
    return sentences(text, *some(rng, STORY_CONSTRAINTS, 0, 2))


@family("creative_writing", "dialogue-scene")
def creative_dialogue(rng):
    a, b = rng.sample(CHARACTERS, 2)
    template = rng.choice([
        "Write a scene in which {a} and {b} argue about {t} in {s}. Use mostly dialogue.",
        "Write a dialogue between {a} and {b} who meet for the first time in {s}.",
        "Write a conversation between {a} and {b} about {t}. Let their personalities show through how they speak.",
        "Write a tense scene set in {s} where {a} has to ask {b} for help.",
    ])
    return sentences(template.format(a=a, b=b, t=rng.choice(DIALOGUE_TOPICS), s=rng.choice(SETTINGS)),
                     *some(rng, STORY_CONSTRAINTS, 0, 1))


@family("creative_writing", "first-line")
def creative_first_line(rng):
    template = rng.choice([
        "Write a short story that begins with this line: \"{l}\"",
        "Continue this story: \"{l}\"",
        "Use this as the first sentence of a piece of flash fiction: \"{l}\"",
        "Here's an opening line I like: \"{l}\" Can you write the next few paragraphs?",
        "Write {genre} story starting with \"{l}\"",
    ])
    return sentences(template.format(l=rng.choice(FIRST_LINES), genre=rng.choice(GENRES)),
                     *some(rng, STORY_CONSTRAINTS, 0, 1))


@family("creative_writing", "letter-or-diary")
def creative_letter(rng):
    c = rng.choice(CHARACTERS)
    template = rng.choice([
        "Write a letter from {c} to their younger self.", "Write a diary entry by {c} after a strange day in {s}.",
        "Write a postcard from {c} on holiday in {s}.",
        "Write a farewell letter from {c} to the place they are leaving: {s}.",
        "Write a series of three text messages sent by {c} on the worst day of their life, with a short scene between "
        "each.",
        "Write an advertisement that {c} puts in a newspaper, and then a short story about who answers it.",
    ])
    return sentences(template.format(c=c, s=rng.choice(SETTINGS)), *some(rng, STORY_CONSTRAINTS, 0, 1))


ANIMALS = ["a hedgehog", "a small owl", "a grumpy badger", "a curious fox cub", "a sleepy bear", "a brave mouse",
           "a penguin who wants to fly", "a beaver who can't build dams", "a lost duckling", "a very tall giraffe",
           "a shy octopus"]
KID_CONFLICTS = ["is afraid of the dark", "wants to find the end of the rainbow", "loses a favourite blanket",
                 "has to share a room for the first time", "can't fall asleep before a big day", "makes a new friend",
                 "learns that it's fine to be different", "helps the moon find its way home",
                 "goes to school for the first time"]


@family("creative_writing", "childrens-story")
def creative_children(rng):
    template = rng.choice([
        "Write a bedtime story for a five-year-old about {a} who {k}.", "Write a children's story about {a} who {k}.",
        "Could you write a short picture-book story about {a} who {k}? Use simple words and a gentle ending.",
        "Make up a story for my daughter about {a} who {k}. She's six.",
        "Write a fable about {a} who {k}, with a moral at the end.",
    ])
    return template.format(a=rng.choice(ANIMALS), k=rng.choice(KID_CONFLICTS))


@family("creative_writing", "worldbuilding", weight=0.6)
def creative_world(rng):
    s = rng.choice(SETTINGS)
    return rng.choice([
        f"Describe {s} in rich detail, as if it were the opening of a fantasy novel.",
        f"Invent a legend that the people of {s} tell their children, and write it out.",
        f"Write a travel-guide entry for {s}, as if it were a real place.",
        f"Create three characters who live in {s} and write a paragraph introducing each of them.",
        f"Write a news report about something unusual that happened in {s}.",
    ])


# ============================================================================================== poetry
POEM_TOPICS = [
    "the first frost of winter", "a city waking up", "the smell of cut grass", "an old pair of boots",
    "learning to swim", "the last day of summer", "a grandfather's workshop", "the night sky over a frozen lake",
    "a windmill", "moving to a new country", "the sound of a church bell", "a cup of hot chocolate",
    "conkers in October", "a heatwave", "a long goodbye at an airport", "the moon over a sleeping town", "a lost key",
    "friendship", "a busy train station", "the first swim of summer", "a closed ice-cream kiosk", "a garden after rain",
    "growing older", "a letter never sent", "a fishing boat at dawn", "a cat sleeping in the sun",
    "the silence after an argument", "a library at closing time", "wildflowers by a motorway", "a mountain lake",
    "a kite on a windy day", "bread baking", "the end of a long journey", "a dog waiting at the door", "fireflies",
    "a kite caught in a tree", "a street market", "the hum of a refrigerator at night", "a squeaky gate", "the stars",
    "a river in flood", "a first day at school", "a noisy neighbour", "an old photograph", "a winter forest", "hope",
    "patience", "the colour green", "a forgotten song", "city foxes", "the changing seasons", "a child's drawing",
    "a sunflower field", "rain on a tin roof", "time", "a harbour at night", "waiting for results", "a dragonfly",
    "a power cut", "the last leaf on a tree", "courage", "a grandfather's watch", "the smell of books",
    "migrating birds", "a quiet Sunday morning", "the tide going out",
]
LIMERICK_SUBJECTS = [
    "a hamster who trains for a marathon on its wheel", "a barber who is afraid of scissors",
    "a goat who learned to use a phone", "a librarian who can't stop sneezing", "a dentist who hates sweets",
    "a penguin on holiday in Spain", "a wizard who keeps losing his hat", "a snail in a running race",
    "a fox who opened a bakery", "a baker from Leeds", "a tortoise who wants to be a pilot",
    "a crow who collects shiny spoons", "a sheep who can't fall asleep", "my neighbour's very loud rooster",
    "a teacher whose chalk keeps breaking", "a robot who loves to dance", "a ghost who is scared of the dark",
    "a goldfish with big ambitions", "an alarm clock that oversleeps", "a squirrel who hides too many nuts",
    "a cow who wants to be a jockey", "a plumber named Sue",
]
ACROSTIC_WORDS = ["OCEAN", "SPRING", "HOPE", "WINTER", "FRIEND", "COFFEE", "MUSIC", "SUMMER", "LIGHT",
                  "DREAM", "FAMILY", "RIVER", "TEACHER", "BOOKS", "STARS", "HOME", "KINDNESS", "BREAD"]
POEM_CONSTRAINTS = [
    "Make it melancholy.", "Make it joyful.", "Keep the tone playful.", "Use vivid imagery.",
    "Don't use the word 'love'.", "Include a colour in every stanza.", "End with a question.",
    "Write it from the point of view of an object.", "Use simple words a child could read.", "Give it a title.",
    "Include the sound of something.", "Use at least one metaphor and one simile.", "Make the last line surprising.",
    "Keep it under 14 lines.", "Repeat one line as a refrain.", "Write it in the second person.",
]
POEM_FORMS = [
    ("Write a haiku about {t}.", 0),
    ("Write three haiku about {t}, each focusing on a different sense.", 0),
    ("Write a Shakespearean sonnet about {t}.", 1),
    ("Write a Petrarchan sonnet about {t}.", 1),
    ("Write a free-verse poem about {t}.", 2),
    ("Write a poem of four rhyming quatrains about {t} with an ABAB rhyme scheme.", 2),
    ("Write a poem in three quatrains about {t}, rhyming AABB.", 2),
    ("Write a short poem in rhyming couplets about {t}.", 2),
    ("Write a tanka about {t}.", 0),
    ("Write a villanelle about {t}.", 1),
    ("Write a ballad that tells a story about {t}.", 1),
    ("Write an ode to {t}.", 2),
    ("Write a cinquain about {t}.", 0),
    ("Write a prose poem about {t}.", 2),
    ("Write a poem about {t} for a greeting card.", 2),
    ("Write song lyrics, with two verses and a chorus, about {t}.", 1),
    ("Write a children's rhyme about {t}.", 2),
    ("Write a poem about {t} in which every stanza begins with the same word.", 2),
    ("Write a short elegy for {t}.", 1),
    ("Could you write me a poem about {t}? About 12 lines.", 2),
    ("I'd love a poem about {t} to read aloud at a family dinner.", 2),
]


@family("poetry", "form-and-topic", weight=5)
def poetry_form(rng):
    template, n_constraints = rng.choice(POEM_FORMS)
    return sentences(template.format(t=rng.choice(POEM_TOPICS)),
                     *some(rng, POEM_CONSTRAINTS, 0, min(n_constraints, 2)))


@family("poetry", "limerick")
def poetry_limerick(rng):
    template = rng.choice(["Write a limerick about {s}.", "Write two limericks about {s}.",
                           "Can you write a funny limerick about {s}?",
                           "Write a limerick about {s}, and then explain its rhyme scheme."])
    return template.format(s=rng.choice(LIMERICK_SUBJECTS))


@family("poetry", "acrostic")
def poetry_acrostic(rng):
    word = rng.choice(ACROSTIC_WORDS)
    return rng.choice([f"Write an acrostic poem using the word {word}.",
                       f"Write an acrostic poem where the first letters of the lines spell {word}. Make it about "
                       f"{rng.choice(POEM_TOPICS)}.",
                       f"Can you make an acrostic poem for the word \"{word.lower()}\" for my class?"])


@family("poetry", "poem-with-explanation")
def poetry_explained(rng):
    t = rng.choice(POEM_TOPICS)
    return rng.choice([
        f"Write a short poem about {t}, then explain the main image you used.",
        f"Write a poem about {t} and then describe the rhyme scheme and meter you chose.",
        f"Write two short poems about {t}: one that rhymes and one in free verse. Which works better, and why?",
        f"Write a poem about {t} in the style of a nursery rhyme, then rewrite it as a modern free-verse poem.",
    ])


# ================================================================================== grammar_correction
# Sentence templates: {fills} from pools, and [correct|wrong] slots of which one to three get the wrong form.
GRAMMAR_TEMPLATES = [
    "{Name} [goes|go] to the {place} every {weekday}, but last week {he} [stayed|stay] home because {he} [was|were] "
    "ill.",
    "[Their|There] {animal} [is|are] always sleeping on the neighbours' porch.",
    "[It's|Its] obvious that the company has lost [its|it's] way.",
    "We [were|was] planning to visit [the|] museum on {weekday}, but it [was|were] closed.",
    "If we [had|would have] left earlier, we [would have|would of] caught the train.",
    "{Name} and I [went|go] to [a|] {event} last night, and it [lasted|last] for three hours.",
    "Every one of the runners [has|have] to wear [their|there] number on the front.",
    "[You're|Your] going to need [your|you're] passport at the airport.",
    "The {items} on the shelf [were|was] covered in dust, so I [cleaned|clean] them.",
    "{Name} has lived in {city} [since|for] 2015 and [speaks|speak] the local language well.",
    "The queue at the {place} was longer [than|then] usual, so we [left|leaved] early.",
    "After the meeting[,|] we [went|goes] out for lunch at [an|a] Italian restaurant.",
    "Neither the coach nor the players [were|was] ready for the storm.",
    "{He} [never tells anyone|never tells nobody] about {his} plans for the weekend.",
    "The results of the survey [were|was] surprising, and we [need|needs] to discuss them.",
    "[Who's|Whose] coming to the {event}, and [whose|who's] car are we taking?",
    "When I [arrived|arrive] at the station, the train [had|has] already left.",
    "My {relative} [bought|buyed] a new bike last month and [rode|rided] it to work.",
    "The coach gave the medals to Sam and [me|I] after the race.",
    "[{Name} and I|Me and {Name}] [are|is] working on the project together.",
    "The {animal} [has|have] hurt [its|it's] paw, so [it's|its] staying indoors.",
    "I [could have|could of] finished the essay if I [had|would have] started earlier.",
    "[An|A] hour later, we [found|finded] [an|a] umbrella under [the|] bench.",
    "There [were|was] a lot of {items} at the market, but the prices [were|was] high.",
    "{Name} asked me [whether|weather] the [weather|whether] would be good enough for {activity}.",
    "The jacket [that|who] I bought online [is|are] too small.",
    "I have [been|be] waiting for [an|a] answer since {weekday}.",
    "[Let's|Lets] meet at [the|] {place} at noon. [I'll|Ill] bring some snacks.",
    "The cat [lay|laid] in the sun all afternoon because it [was|were] warm.",
    "We sold [fewer|less] tickets than last year, so the {event} [made|maked] a loss.",
    "Everyone [was|were] surprised when our team [won|winned] the final.",
    "I [am|is] going to the {place} tomorrow. [Do|do] you want to come?",
    "Although it [was|were] raining, we [decided|decide] to walk to the {place}.",
    "Yesterday {Name} [wrote|writes] three emails and [called|calls] two clients.",
    "[It's|Its] three years since we last [saw|seen] the sea.",
    "{He} [should have|should of] [told|telled] us about the delay.",
    "My friends [are|is] coming over, so I [need|needs] to clean [the|] kitchen.",
    "The neighbours [were|was] having dinner in [the|] garden when the lights [went|go] out.",
    "[Whose|Who's] turn is it to do [the|] dishes tonight?",
    "The price of the tickets [has|have] gone up again this year.",
    "We [have|has] lived here for [a|an] year and [have|has] never [seen|saw] snow.",
    "The [women's|womens] team [has|have] won every match this season.",
    "My [sister's|sisters] car [is|are] in the garage again.",
    "The [company's|companys] profits [rose|raised] sharply last year.",
    "[I|i] think [it's|its] too late to change the plan now.",
    "The {dish} tasted [better|more better] than I [expected|expect].",
    "This is the [best|most best] {dish} I [have|has] ever eaten.",
    "If the bus [is|will be] late again, I [will|would] walk to work.",
    "{He} [doesn't|don't] have [any|no] time to [lose|loose].",
    "We [were|where] surprised to see how much the town [had|has] changed.",
    "I [wanted|want] to [accept|except] the offer yesterday, but the salary [was|were] too low.",
    "Then we [took|taked] a taxi back to [the|] hotel because we [were|was] exhausted.",
    "Do you know [where|were] the nearest pharmacy [is|are]?",
    "Everybody [needs|need] to sign [their|there] name on the list before [entering|enter].",
    "The {items} [were|was] delivered yesterday, but two of them [were|was] broken.",
    "[A|An] university in {city} [has|have] offered {him} a place.",
    "It was [an|a] honest mistake, and {he} [apologised|apologise] straight away.",
    "My {relative} [has|have] [a|an] old car that [doesn't|don't] start in winter.",
    "The players [are|is] meeting on {weekday}, and [they're|their] bringing [their|they're] kit.",
    "{Name} [taught|teached] {his} little brother how to swim last summer.",
    "We [caught|catched] the last bus and [got|get] home just before midnight.",
    "I [used to|use to] play the piano, but I [haven't|haven't never] practised for years.",
    "[There's|Theirs] no reason to worry; the {event} [has|have] been postponed.",
    "The weather [affected|effected] our plans, so we [stayed|stay] in {city} an extra day.",
    "{He} [ran|runned] to the {place} because {he} [was|were] late for the {event}.",
    "[Its|It's] hard to say [whether|wether] the plan will work.",
    "My parents [were|was] born in {city}, and they still [visit|visits] every year.",
    "Can I borrow your pen? Mine [has|have] [run|ran] out of ink.",
    "The {animal} [hasn't|haven't] eaten since {weekday}, so we [are|is] taking it to the vet.",
]
GRAMMAR_FILLS = {
    "place": ["library", "station", "supermarket", "gym", "post office", "park", "cinema", "swimming pool", "bakery"],
    "city": CITIES,
    "weekday": WEEKDAYS,
    "relative": ["sister", "brother", "cousin", "uncle", "aunt", "neighbour", "grandfather", "flatmate"],
    "items": ["books", "plates", "boxes", "chairs", "jars", "vases", "lamps", "parcels"],
    "event": ["concert", "meeting", "workshop", "party", "match", "exhibition", "wedding", "lecture"],
    "animal": ["dog", "cat", "horse", "parrot", "rabbit", "puppy", "pony"],
    "dish": ["soup", "curry", "lasagne", "pie", "risotto", "cake", "paella"],
    "activity": ["a picnic", "a hike", "a bike ride", "a barbecue", "a day at the beach", "sailing"],
}
SLOT = re.compile(r"\[([^|\]]*)\|([^\]]*)\]")


def faulty_sentence(rng: random.Random) -> str:
    """One template sentence with its pools filled and one to three slots given the wrong form."""
    name, he, him, his = person(rng)
    fills = {k: rng.choice(v) for k, v in GRAMMAR_FILLS.items()}
    template = rng.choice(GRAMMAR_TEMPLATES).format(Name=name, he=he, He=he.capitalize(), him=him, his=his, **fills)
    slots = list(SLOT.finditer(template))
    wrong = {m.start() for m in rng.sample(slots, min(len(slots), rng.choice([1, 1, 2, 2, 3])))}
    text = SLOT.sub(lambda m: m.group(2) if m.start() in wrong else m.group(1), template)
    text = " ".join(text.split())
    if rng.random() < 0.15:
        text = text[0].lower() + text[1:]
    if rng.random() < 0.1:
        text = text.rstrip(".")
    return text


GRAMMAR_SENTENCE_INSTRUCTIONS = [
    "Correct the grammar in this sentence: \"{s}\"", "Please fix any grammar mistakes: \"{s}\"",
    "Can you proofread this and explain what you changed? \"{s}\"",
    "Fix the errors in the following sentence and explain each correction.\n\n{s}",
    "Is this sentence grammatically correct? If not, rewrite it: \"{s}\"",
    "Rewrite this with correct grammar and punctuation: {s}",
    "I'm not a native speaker. Could you correct this sentence for me and tell me why? \"{s}\"",
    "What's wrong with this sentence? \"{s}\"", "My {doc} has this sentence in it: \"{s}\" Can you fix it?",
    "Correct this, giving the corrected version first and then a short explanation: \"{s}\"",
    "Find and fix the mistakes: {s}", "Edit for grammar and spelling, and list every error you found:\n\n{s}",
    "Help me improve this sentence so it sounds natural and correct: \"{s}\"",
]
GRAMMAR_PARAGRAPH_INSTRUCTIONS = [
    "Proofread the following paragraph:\n\n{p}", "Please correct this text and explain the main errors:\n\n{p}",
    "Can you fix the grammar in this {doc}?\n\n{p}",
    "Edit this paragraph for grammar, spelling and punctuation.\n\n{p}",
    "Here's part of my {doc}. Please correct the mistakes and list them:\n\n{p}",
    "Rewrite the following so that it is grammatically correct, keeping the meaning:\n\n{p}",
]
DOCS = ["essay", "cover letter", "email", "report", "blog post", "school assignment", "wedding speech", "thesis"]


@family("grammar_correction", "faulty-sentence", weight=3)
def grammar_sentence(rng):
    return rng.choice(GRAMMAR_SENTENCE_INSTRUCTIONS).format(s=faulty_sentence(rng), doc=rng.choice(DOCS))


@family("grammar_correction", "faulty-paragraph")
def grammar_paragraph(rng):
    paragraph = " ".join(faulty_sentence(rng) for _ in range(rng.randint(2, 4)))
    return rng.choice(GRAMMAR_PARAGRAPH_INSTRUCTIONS).format(p=paragraph, doc=rng.choice(DOCS))


# ========================================================================================== factual_qa
FACT_CONCEPTS = {
    "science": [
        "the greenhouse effect", "entropy", "the Coanda effect", "nuclear fusion", "nuclear fission",
        "static electricity", "superconductivity", "the photoelectric effect", "a quasar", "dark matter",
        "the Big Bang theory", "the Kuiper belt", "the nitrogen cycle", "the carbon cycle", "ocean acidification",
        "ocean currents", "radioactive decay", "half-life", "an isotope", "a covalent bond", "an ionic bond",
        "the periodic table", "a catalyst", "the pH scale", "oxidation", "electromagnetic induction", "inertia",
        "friction", "momentum", "kinetic energy", "buoyancy", "refraction", "the electromagnetic spectrum",
        "absolute zero", "a light-year", "a neutron star", "a supernova", "an exoplanet", "the Coriolis effect",
        "the jet stream", "El Niño", "a solar eclipse", "surface tension", "thermal conductivity",
        "a chemical equilibrium", "the speed of sound", "a magnetic field", "centripetal force", "the Higgs boson",
        "a semiconductor", "osmosis", "diffusion",
    ],
    "biology": [
        "RNA", "a gene", "natural selection", "evolution", "mitosis", "meiosis", "the digestive system", "a virus",
        "herd immunity", "the gut microbiome", "cellular respiration", "the nervous system", "homeostasis",
        "biodiversity", "a food chain", "an ecosystem", "symbiosis", "CRISPR", "vaccination", "metabolism",
        "the circadian rhythm", "an apex predator", "pollination", "hibernation", "the placebo effect", "cholesterol",
        "insulin", "the blood-brain barrier", "the lymphatic system", "transpiration in plants", "a mutation",
        "an invasive species", "the endocrine system", "genetic inheritance", "a coral reef ecosystem",
        "the human genome",
    ],
    "history": [
        "feudalism", "the Abbasid Caliphate", "the Industrial Revolution", "colonialism",
        "the Great Zimbabwe civilisation", "the Enlightenment", "the Domesday Book", "the Reformation",
        "the Byzantine Empire", "the Ottoman Empire", "the Meiji Restoration", "apartheid", "the civil rights movement",
        "the suffragette movement", "the Space Race", "the Bretton Woods system", "the League of Nations",
        "the Mughal Empire", "the Inca road system", "the Code of Hammurabi", "the Mali Empire", "the Bronze Age",
        "the Agricultural Revolution", "the Hundred Years' War", "mercantilism",
    ],
    "geography": [
        "a river delta", "a fjord", "the monsoon", "desertification", "a rain shadow", "an oxbow lake", "permafrost",
        "the Ring of Fire", "the tundra", "a savanna", "latitude and longitude", "urbanisation",
        "the International Date Line", "continental drift", "erosion", "an archipelago", "the Gulf Stream",
        "a watershed", "groundwater", "a geyser", "a glacier", "a tectonic plate boundary", "the Mediterranean climate",
        "an atoll", "a mangrove forest", "the Sahel", "a volcanic hotspot", "a floodplain", "population density",
    ],
    "technology": [
        "an algorithm", "edge computing", "a neural network", "cloud computing", "encryption",
        "public-key cryptography", "a blockchain", "DNS", "an IP address", "HTTP", "a compiler", "an operating system",
        "RAM", "a GPU", "a hash function", "a relational database", "an API", "version control", "5G", "GPS", "Wi-Fi",
        "a QR code", "containerisation", "phishing", "a VPN", "a solid-state drive", "a lithium-ion battery",
        "3D printing", "the Internet of Things", "virtual reality", "a large language model", "Moore's law",
        "the binary number system", "a firewall", "a web browser cookie", "network latency", "bandwidth",
        "a data centre", "an electric motor", "a transistor", "a search engine", "a load balancer",
    ],
    "economics": [
        "inflation", "deflation", "purchasing power parity", "moral hazard", "GDP", "a central bank", "a recession",
        "economies of scale", "the stock market", "diversification", "an index fund", "unemployment", "a tariff",
        "comparative advantage", "a monopoly", "an externality", "the tragedy of the commons", "behavioural economics",
        "the gig economy", "universal basic income", "a budget deficit", "national debt", "an exchange rate",
        "cryptocurrency", "microfinance", "game theory", "the prisoner's dilemma", "quantitative easing",
        "a pension fund", "a mortgage", "fiat money", "a progressive tax", "the law of diminishing returns",
        "a trade deficit",
    ],
    "ideas": [
        "cognitive dissonance", "confirmation bias", "the Dunning-Kruger effect", "impostor syndrome",
        "a growth mindset", "classical conditioning", "utilitarianism", "stoicism", "the scientific method",
        "Occam's razor", "art deco", "the social contract", "existentialism", "a peer-reviewed study",
        "the bystander effect", "a dialect",
    ],
}
CONCEPT_TEMPLATES = [
    "What is {c}?", "What is {c}, and why does it matter?", "Explain {c} in simple terms.",
    "Can you explain {c} to a high school student?", "Give me a clear explanation of {c}, with an example.",
    "Tell me about {c}.", "Describe {c} in a few paragraphs.", "Explain {c} as if I were ten years old.",
    "Write a short explainer on {c}.", "What are the key ideas behind {c}?",
    "Give me a beginner-friendly overview of {c}.", "Explain {c} and give a real-world example.",
    "What is {c}? Please keep the explanation short but accurate.", "What do scientists and experts mean by {c}?",
    "Explain the concept of {c} and one common misconception about it.",
]
# only for concepts without an indefinite article ("the greenhouse effect", "inflation", not "a gene")
NAMED_CONCEPT_TEMPLATES = ["What is {c} and how does it work?", "I keep hearing people mention {c}. What does it mean?"]


@family("factual_qa", "concept", weight=4)
def fact_concept(rng):
    field = rng.choice(sorted(FACT_CONCEPTS))
    concept = rng.choice(FACT_CONCEPTS[field])
    named = not concept.startswith(("a ", "an "))
    return rng.choice(CONCEPT_TEMPLATES + (NAMED_CONCEPT_TEMPLATES if named else [])).format(c=concept)


WHY_QUESTIONS = [
    "Why do we have seasons?", "Why does water expand when it freezes?", "Why do leaves change colour in autumn?",
    "Why is the ocean salty?", "Why do dogs wag their tails?", "Why do we dream?",
    "Why did the Western Roman Empire fall?", "Why do onions make you cry?",
    "Why do some trees lose their leaves in winter while others don't?", "Why do planes leave white trails in the sky?",
    "Why do we blush?", "Why is Venus hotter than Mercury?", "Why does bread go stale?", "Why do we get goosebumps?",
    "Why does metal feel colder than wood at the same temperature?", "Why did the dinosaurs die out?",
    "Why do stars twinkle?", "Why do our ears pop on a plane?", "Why is biodiversity important?",
    "Why do prices tend to rise over time?", "Why do countries trade with each other?",
    "Why are bees important to farming?", "Why does the Earth have a magnetic field?",
    "Why do some people need glasses?", "Why do humans have different blood types?",
    "Why do we get a fever when we're ill?", "Why do we feel groggy after a long nap?",
    "Why does a compass point north?", "Why do coastal areas have milder climates?", "Why is the Dead Sea so salty?",
    "Why did the Industrial Revolution begin in Britain?", "Why do hurricanes spin?",
    "Why do deserts get cold at night?", "Why do computers use binary?", "Why does a phone battery wear out over time?",
    "Why do some materials conduct electricity and others don't?", "Why do birds migrate?",
    "Why are peat bogs important for the climate?", "Why do some countries use daylight saving time?",
    "Why do apples turn brown after being cut?", "Why does salt melt ice on roads?",
    "Why can't we see stars during the day?", "Why do fireworks have different colours?", "Why does hot air rise?",
    "Why do high mountains keep snow in summer?", "Why do we age?", "Why do some foods spoil faster than others?",
    "Why did Rome build so many aqueducts?", "Why do central banks raise interest rates?",
    "Why do stock prices go up and down?", "Why do some languages have gendered nouns?",
    "Why was the invention of zero so important in mathematics?", "Why do we see lightning before we hear thunder?",
    "Why do rivers meander?", "Why does the Sahara get so little rain?",
    "Why does the Moon always show the same face to Earth?", "Why are tomatoes botanically a fruit?",
    "Why do some vaccines need boosters?", "Why do we have fingerprints?",
    "Why are cities warmer than the countryside?", "Why do some countries drive on the left?",
    "Why is carbon dioxide a greenhouse gas?", "Why do we get hiccups?",
    "Why does the sea look blue while water in a glass looks clear?", "Why do cut flowers wilt?",
    "Why do wounds itch as they heal?", "Why did the Black Death spread so quickly?",
    "Why do economies go through boom and bust cycles?",
]
HOW_QUESTIONS = [
    "How does the immune system remember past infections?", "How does an air conditioner cool a room?",
    "How do aeroplanes stay in the air?", "How does GPS work out where I am?",
    "How do ants find their way back to the nest?", "How does the heart pump blood around the body?",
    "How do solar panels turn sunlight into electricity?", "How does a microwave oven heat food?",
    "How do noise-cancelling headphones work?", "How does the stock market work?", "How does a mortgage work?",
    "How does a bill become a law in the United States?",
    "How does the internet send data from one computer to another?", "How do touch screens detect a finger?",
    "How do hurricanes form?", "How are mountains formed?", "How do caves form?", "How do the kidneys filter blood?",
    "How do plants know which way is up?", "How does a search engine rank pages?", "How do electric cars work?",
    "How does a nuclear power plant generate electricity?", "How do batteries store energy?",
    "How did the ancient Egyptians build the pyramids?", "How did writing first develop?",
    "How does carbon dating work?", "How are rainbows formed?", "How do fish breathe underwater?",
    "How do chameleons change colour?", "How does memory work in the brain?", "How does caffeine keep you awake?",
    "How do painkillers like ibuprofen work?", "How does the body fight off a cold?",
    "How does inflation affect savings?", "How do banks create money?", "How does insurance work?",
    "How do credit card companies make money?", "How do geckos climb walls?", "How do seeds know when to sprout?",
    "How does a digital camera capture an image?", "How does a 3D printer build objects?",
    "How do streaming services deliver video without buffering?", "How does password hashing keep accounts safe?",
    "How do self-driving cars see the road?", "How does a wind turbine produce electricity?",
    "How does soap remove grease?", "How does yeast make bread rise?", "How do glaciers shape the landscape?",
    "How does a river delta form?", "How did the printing press change Europe?",
    "How did the Silk Road connect East and West?", "How do elections work in a parliamentary system?",
    "How does the United Nations Security Council make decisions?", "How does the human eye see colour?",
    "How do earthquakes happen?", "How are clouds formed?", "How does sound travel?", "How do spiders spin webs?",
    "How are diamonds formed?", "How do muscles grow after exercise?", "How does a thermostat control temperature?",
    "How do submarines dive and surface?", "How does a pin tumbler lock work?", "How does a new medicine get approved?",
    "How do hearing aids work?", "How does a sewing machine make a stitch?",
    "How do vaccines get developed so quickly during a pandemic?", "How does a heat pump warm a house?",
    "How does the body regulate its temperature?", "How do coral reefs form?",
]
QUESTION_SUFFIXES = ["", "", "Explain step by step.", "Keep it simple.", "Please give a detailed answer.",
                     "Explain it to a twelve-year-old.", "Include an example.", "Answer in a few short paragraphs.",
                     "What's the science behind it?"]


@family("factual_qa", "why-question", weight=1.5)
def fact_why(rng):
    return sentences(rng.choice(WHY_QUESTIONS), rng.choice(QUESTION_SUFFIXES))


@family("factual_qa", "how-question", weight=1.5)
def fact_how(rng):
    return sentences(rng.choice(HOW_QUESTIONS), rng.choice(QUESTION_SUFFIXES))


HISTORY_EVENTS = [
    "the Great Fire of London", "the fall of the Western Roman Empire", "the First World War", "the Second World War",
    "the Klondike Gold Rush", "the American Civil War", "the Black Death", "the Protestant Reformation",
    "the collapse of the Soviet Union", "the Russian Revolution", "the partition of India",
    "the first ascent of Everest", "the Great Depression", "the building of the Great Wall of China",
    "the voyages of Zheng He", "the Norman conquest of England", "the Spanish conquest of the Aztec Empire",
    "the abolition of the transatlantic slave trade", "the unification of Germany", "the Haitian Revolution",
    "the rise of the Mongol Empire", "the fall of Constantinople in 1453", "the Cuban Missile Crisis",
    "the end of apartheid in South Africa", "Indian independence", "the Scientific Revolution", "the Crusades",
    "the Great Famine in Ireland", "the Dust Bowl", "the Cultural Revolution in China",
    "the construction of the Suez Canal", "the Berlin Airlift", "the Glorious Revolution", "the Boston Tea Party",
    "the American Revolution", "the Congress of Vienna", "the Meiji era reforms", "the Arab Spring",
    "the Treaty of Versailles", "the Spanish flu pandemic of 1918", "the Irish War of Independence",
]
HISTORY_TEMPLATES = [
    "What caused {e}?", "What were the main consequences of {e}?", "Give me a short overview of {e}.",
    "Why was {e} important?", "Explain {e} to a student who is new to the topic.", "Summarise the key events of {e}.",
    "What can we learn from {e}?", "How did {e} change the world?", "What were the causes and effects of {e}?",
    "Tell me about {e} in about 200 words.", "Who were the key people involved in {e}, and what did they do?",
]


@family("factual_qa", "history-event")
def fact_history(rng):
    return rng.choice(HISTORY_TEMPLATES).format(e=rng.choice(HISTORY_EVENTS))


COMPARISONS = [
    ("a virus", "a bacterium"), ("mitosis", "meiosis"), ("a gene", "a chromosome"), ("speed", "velocity"),
    ("mass", "weight"),
    ("an element", "a compound"), ("a comet", "an asteroid"), ("a meteor", "a meteorite"), ("nuclear fission",
     "nuclear fusion"),
    ("alternating current", "direct current"), ("RAM", "storage"), ("a glacier", "an ice sheet"), ("HTTP", "HTTPS"),
    ("a moth", "a butterfly"), ("a stock", "a bond"), ("inflation", "deflation"),
    ("a recession", "a depression"), ("fiscal policy", "monetary policy"), ("a direct democracy",
     "a representative democracy"),
    ("an opera", "a musical"), ("a frog", "a toad"), ("a tornado", "a hurricane"), ("a sea", "an ocean"),
    ("a hypothesis", "a theory"), ("correlation", "causation"), ("a food allergy", "a food intolerance"),
    ("a cold", "the flu"), ("aerobic exercise", "anaerobic exercise"), ("a star", "a planet"),
    ("a solar eclipse", "a lunar eclipse"), ("renewable energy", "non-renewable energy"), ("Wi-Fi", "Bluetooth"),
    ("a CPU", "a GPU"), ("a computer virus", "a computer worm"), ("the Romantic movement", "the Enlightenment"),
    ("jazz", "blues"), ("a simile", "a metaphor"), ("a hurricane", "a typhoon"), ("introversion", "shyness"),
    ("a debit card", "a credit card"), ("gross salary", "net salary"), ("an LED", "an incandescent bulb"),
    ("baking soda", "baking powder"), ("a psychologist", "a psychiatrist"),
    ("a monarchy", "a republic"), ("weathering", "erosion"), ("an epidemic", "a pandemic"), ("a tsunami",
     "a storm surge"),
    ("a river", "a canal"), ("bacteria", "fungi"), ("an atom", "a molecule"), ("a genotype", "a phenotype"),
    ("a private company", "a public company"), ("a tariff", "a quota"), ("a bear market", "a bull market"),
]
COMPARISON_TEMPLATES = [
    "What is the difference between {a} and {b}?", "Compare {a} and {b}.", "How do {a} and {b} differ?",
    "Explain the difference between {a} and {b}, with examples.",
    "I always mix up {a} and {b}. Can you explain the difference?",
    "What do {a} and {b} have in common, and how are they different?", "Compare {a} with {b} in a short table.",
]


@family("factual_qa", "comparison", weight=1.5)
def fact_comparison(rng):
    a, b = rng.choice(COMPARISONS)
    if rng.random() < 0.5:
        a, b = b, a
    return rng.choice(COMPARISON_TEMPLATES).format(a=a, b=b)


PEOPLE = [
    ("Marie Curie", "she"), ("Dmitri Mendeleev", "he"), ("Mary Seacole", "she"), ("Leonardo da Vinci", "he"),
    ("Srinivasa Ramanujan", "he"), ("Mahatma Gandhi", "he"), ("Charles Darwin", "he"), ("Albert Einstein", "he"),
    ("Rosalind Franklin", "she"), ("Alan Turing", "he"), ("Cleopatra", "she"), ("Genghis Khan", "he"),
    ("Ibn Battuta", "he"), ("Galileo Galilei", "he"), ("Florence Nightingale", "she"), ("Nikola Tesla", "he"),
    ("Confucius", "he"), ("Aristotle", "he"), ("Simón Bolívar", "he"), ("Ida B. Wells", "she"),
    ("William Shakespeare", "he"), ("Wangari Maathai", "she"), ("Johannes Gutenberg", "he"),
    ("Hypatia of Alexandria", "she"), ("Al-Khwarizmi", "he"), ("Mansa Musa", "he"), ("Queen Victoria", "she"),
    ("Abraham Lincoln", "he"), ("Harriet Tubman", "she"), ("Rachel Carson", "she"), ("Grace Hopper", "she"),
    ("Louis Pasteur", "he"), ("Gregor Mendel", "he"), ("Katherine Johnson", "she"), ("Ludwig van Beethoven", "he"),
    ("Jane Austen", "she"), ("Nicolaus Copernicus", "he"), ("Emmeline Pankhurst", "she"), ("Akbar the Great", "he"),
    ("Ibn Sina", "he"), ("Murasaki Shikibu", "she"),
]


@family("factual_qa", "historical-figure")
def fact_person(rng):
    who, he = rng.choice(PEOPLE)
    return rng.choice([f"Who was {who}, and what is {he} known for?", f"Give me a short biography of {who}.",
                       f"What were {who}'s most important achievements?", f"Why is {who} considered so important?",
                       f"Tell me about {who} and the world {he} lived in.",
                       f"What influence did {who} have on later generations?"])


# ============================================================================================== advice
ADVICE_SITUATIONS = {
    "study": [
        "I'm a second-year university student and I can't decide what to specialise in.",
        "I failed my first statistics assignment and need to catch up.",
        "I want to learn Spanish on my own but I keep losing motivation after a few weeks.",
        "I read my notes again and again but forget everything by the exam.",
        "I'm starting an evening course in accounting while working full time.",
        "My teenage son says he can't concentrate on homework with his phone nearby.",
        "I have to write a 5,000-word dissertation chapter and I don't know where to start.",
        "I'm teaching myself to code in the evenings after work.",
        "I freeze up during timed exams even when I know the material.",
        "I need to pass a driving theory test next month.",
        "I'm starting an online degree and have never studied remotely before.",
        "I'm bad at maths and need to improve before a nursing entrance exam.",
    ],
    "career": [
        "I've been in the same job for six years and feel stuck.",
        "I have a second-round interview that includes a case study presentation.",
        "I want to move from teaching into instructional design.",
        "My manager gives me vague feedback and I don't know how I'm doing.",
        "I got two job offers: one pays more, the other has better colleagues.",
        "I want to ask my manager if I can work a four-day week.",
        "I've been asked to mentor a new colleague for the first time.",
        "I'm a recent graduate and I can't get interviews despite sending lots of applications.",
        "I want to start freelancing as a graphic designer while keeping my day job.",
        "A colleague keeps interrupting me in meetings.",
        "I'm thinking of quitting my stable job to start a small bakery.",
        "I have to run my first training workshop for thirty people.",
        "My contract ends in two months and it won't be renewed.",
    ],
    "health habits": [
        "I want to take up swimming but I'm not a confident swimmer.",
        "I keep snacking late at night and want to stop.",
        "My wrists ache after long days of typing.",
        "I want to drink less coffee without feeling terrible.",
        "I want to eat more fruit but always forget to buy it.",
        "I want to get stronger for hiking but I've never lifted weights.",
        "I get a headache every afternoon at work.",
        "I'd like to cook healthier meals but I'm not a confident cook.",
        "I want to cut down on screen time in the evenings.",
        "I get stressed easily and want a simple daily habit that helps.",
        "I'd like to cycle to work but the route feels unsafe.",
        "I want to spend less time sitting on the sofa in the evenings.",
    ],
    "money": [
        "I never seem to have any money left at the end of the month.",
        "I keep lending money to friends and never get it back.",
        "I've just received a small inheritance and don't know what to do with it.",
        "I want to save for a deposit on a flat within five years.",
        "I want to stop buying coffee out every day without feeling deprived.",
        "I spend too much on takeaways and subscriptions.",
        "I want to buy a second-hand piano and don't know what a fair price is.",
        "I want to give more to charity but don't know how much is sensible.",
        "I want to teach my ten-year-old about money.",
        "I'm planning a wedding on a limited budget.",
        "I'm a student living on a very small budget.",
        "I've been offered a pension plan at work and don't understand it.",
    ],
    "travel": [
        "I'm going on a week-long walking holiday with people I've never met.",
        "I'm going to Portugal for two weeks and want to eat like a local.",
        "I want to travel around Europe by train for a month on a budget.",
        "I get very anxious on long flights.",
        "We're taking my elderly parents on a city break.",
        "I have three days in a city I've never visited.",
        "I'm going to a friend's wedding abroad and have never flown before.",
        "I'm going hiking in the mountains for the first time this summer.",
        "I'm moving abroad for work and have never lived in another country.",
        "I'd like to travel more sustainably.",
        "I'm visiting a country where I don't know the customs.",
    ],
    "relationships": [
        "My oldest friend forgot my birthday and I feel hurt.",
        "I've moved to a town where I don't speak the language well.",
        "My flatmate keeps inviting guests over without asking.",
        "My parents don't approve of my career choice.",
        "I always end up paying when I go out with friends.",
        "My partner and I have very different ideas about how to spend weekends.",
        "I want to reconnect with a friend I lost touch with years ago.",
        "A friend keeps borrowing my clothes and returning them damaged.",
        "My teenage daughter wants to quit the piano after eight years.",
        "I need to tell a friend that I can't be a bridesmaid at her wedding.",
        "My neighbour's tree drops leaves all over my garden.",
        "I've been asked to give a speech at my brother's wedding.",
    ],
    "productivity": [
        "I always leave my tax return until the last minute.",
        "My inbox has 3,000 unread emails and it stresses me out.",
        "I work from home and find it hard to stop working in the evening.",
        "I have too many side projects and finish none of them.",
        "I get distracted by my phone every few minutes.",
        "My to-do list keeps growing no matter how much I do.",
        "I waste the first hour of every workday.",
        "I have back-to-back meetings and no time for focused work.",
        "I lose my keys and wallet at least once a week.",
        "I want to write a novel but never find the time.",
        "My desk and computer files are a complete mess.",
    ],
    "home": [
        "My garden is overgrown and I don't know where to start.",
        "I want to start a vegetable garden on my balcony.",
        "I'm moving house next month and feel overwhelmed.",
        "I want to make my bathroom feel less cramped.",
        "I just adopted a rescue dog who is scared of everything.",
        "I want to cook at home more but end up ordering food.",
        "I'm living alone for the first time.",
        "I want to make my home more welcoming for guests.",
    ],
}
ADVICE_CONSTRAINTS = ["Money is tight right now.", "I work night shifts.", "I have two young kids.",
                      "I'm quite introverted.", "I'm in my fifties.", "English is my second language.",
                      "I tend to overthink things.", "I get bored easily.", "I have ADHD.", "I travel a lot for work."]
ADVICE_CATEGORY_CONSTRAINTS = {
    "study": ["I only have about an hour a day to study.", "I've tried study apps before and gave up after a week.",
              "I share a small flat with three other people."],
    "career": ["I live in a small town with few employers.", "I can't afford to go without pay for long.",
               "I've been with the same company since I graduated."],
    "health habits": ["I only have about 30 minutes a day.", "I've tried fitness apps before and gave up after a week.",
                      "I have a bad knee.", "I don't have access to a gym."],
    "money": ["I'm paid monthly but my rent is due mid-month.", "I'm self-employed.", "I'm a student."],
    "travel": ["I've never travelled alone before.", "I don't drive.", "I'm vegetarian."],
    "relationships": ["I hate confrontation.", "We've been friends since primary school.", "I'm new to the area."],
    "productivity": ["I work in an open-plan office.", "I've tried productivity apps before and gave up after a week.",
                     "My job involves a lot of interruptions."],
    "home": ["I rent, so I can't make big changes.", "I don't have a car.", "I live in a small town with few shops."],
}
ADVICE_ASKS = [
    "What should I do?", "Can you give me a practical plan?", "What are some realistic steps I can take?",
    "How should I approach this?", "What would you suggest?", "Any advice?", "Give me five concrete tips.",
    "Can you help me make a plan for the next {n} weeks?", "What mistakes should I avoid?", "Where do I start?",
    "What would you do in my position?", "Please give me a few options and the pros and cons of each.",
    "Can you suggest a simple routine I could stick to?", "How can I make progress without burning out?",
    "Explain why each tip helps.",
]


@family("advice", "situation", weight=4)
def advice_situation(rng):
    category = rng.choice(sorted(ADVICE_SITUATIONS))
    situation = rng.choice(ADVICE_SITUATIONS[category])
    extra = ADVICE_CONSTRAINTS + ADVICE_CATEGORY_CONSTRAINTS[category]
    constraint = rng.choice(extra) if rng.random() < 0.45 else ""
    ask = rng.choice(ADVICE_ASKS).format(n=rng.choice([2, 4, 6, 8, 12]))
    return sentences(situation, constraint, ask)


ADVICE_GOALS = [
    "stop interrupting people in conversations", "become a better listener",
    "compare broadband deals without getting confused", "keep in touch with friends who live abroad",
    "get better at telling stories", "plan a surprise party", "read more books", "take better photos with my phone",
    "stay motivated during a long project", "prepare for a difficult conversation with my landlord",
    "deal with a difficult coworker", "start exercising again after a long break", "organise my week",
    "handle criticism without getting defensive", "build a habit of journaling", "grow herbs on a windowsill",
    "plan a trip on a tight budget", "learn to cook five simple meals", "feel more confident in job interviews",
    "be more patient with my kids", "manage stress before exams", "set boundaries with my family",
    "network without feeling awkward", "write a strong CV", "get out of a creative rut",
]


@family("advice", "how-can-i")
def advice_goal(rng):
    goal = rng.choice(ADVICE_GOALS)
    template = rng.choice(["How can I {g}?", "What's the best way to {g}?", "I want to {g}. Where should I begin?",
                           "Give me some practical advice on how to {g}.", "Any tips to help me {g}?",
                           "My goal this month is to {g}. Can you help me make a plan?"])
    return sentences(template.format(g=goal), rng.choice(ADVICE_CONSTRAINTS) if rng.random() < 0.4 else "",
                     rng.choice(["", "", "Please keep it to five short bullet points.",
                                 "Explain the reasoning behind each suggestion.",
                                 "Be honest with me.", "Keep it practical."]))


@family("advice", "decision")
def advice_decision(rng):
    a, b = rng.choice([
        ("rent a flat with friends", "live alone"), ("take a gap year", "go straight to university"), ("learn Python",
         "learn JavaScript first"),
        ("buy a new car", "buy a used one"), ("move to a big city", "stay in my hometown"),
        ("take the job with the higher salary", "take the one with more flexibility"),
        ("study medicine", "study engineering"), ("go freelance", "stay employed"),
        ("take up running", "take up cycling"), ("lease an electric car", "keep my old petrol car"),
        ("do a master's degree", "start working now"), ("join a gym", "exercise at home"),
        ("travel this year", "save the money"), ("learn guitar", "learn piano"),
    ])
    return rng.choice([f"Should I {a} or {b}? Help me think it through.",
                       f"I can't decide whether to {a} or {b}. What questions should I ask myself?",
                       f"What are the pros and cons of choosing to {a} rather than {b}?",
                       f"My friends say I should {a}, but I'm tempted to {b}. How do I decide?"])


# ========================================================================================= translation
LANGUAGES = {"French": ["France", "Quebec", "Belgium"], "Spanish": ["Spain", "Mexico", "Argentina"],
             "German": ["Germany", "Austria", "Switzerland"], "Italian": ["Italy"],
             "Portuguese": ["Portugal", "Brazil"], "Russian": ["Russia", "Kazakhstan"]}
EN_SENTENCES = [
    "Excuse me, how do I get to the nearest {shop} from here?",
    "I would like to book a {room} for {n} nights, starting on {weekday}.",
    "My {relative} moved to {city} last year to work as {job}.",
    "We are going to {city} next {period} to visit some friends.", "Is this {thing} on sale, or is it full price?",
    "The {meal} was delicious, thank you very much.",
    "Sorry, could you repeat the address? I didn't catch the street name.",
    "Our appointment is now on {weekday} at {time} instead.",
    "Could you send the {document} to my colleague before {weekday}?",
    "It is {weather} today, so the match has been cancelled.", "I have been learning this language for {n} months.",
    "Do you have this {clothing} in a larger size?", "The train to {city} leaves at {time} from platform {n}.",
    "I need to see a doctor; I have had a {symptom} since {weekday}.", "Do you accept contactless payments here?",
    "Turn left at the {landmark} and then go straight on for about two hundred metres.",
    "Thank you for your message. I will reply as soon as possible.",
    "Is it possible to sit outside on the terrace tonight?", "Is there a {shop} near the hotel?",
    "I think I left my {item} on the bus this morning.",
    "My {relative}'s birthday is on {weekday}, and we are planning a surprise party.",
    "The children are playing in the garden while their parents cook dinner.",
    "Could you help me move this table into the kitchen?",
    "I usually get up at {time} and go for a walk before breakfast.", "Is the {shop} open late on {weekday}s?",
    "Does this dish contain {allergen}? My son has an allergy.",
    "The airline lost our luggage, so we have to buy new clothes in {city}.", "Excuse me, is this seat free?",
    "Has anyone found a black {item}? I think I dropped it here.", "We stayed in {city} for a week and loved the food.",
    "Could you recommend a good {meal} place nearby?", "The {document} is attached to this email.",
    "Please call me back when you have a moment.", "I'd like to return this {clothing}; it doesn't fit.",
    "How long does it take to get to the {landmark} on foot?", "It's my first time in {city}. What should I see?",
    "My phone battery is almost dead. Is there somewhere I can charge it?",
    "I can't wait to show you around {city} next {period}.", "Sorry, I have to leave early today; my son is ill.",
    "We need to leave early tomorrow to catch the {time} bus.", "Could you write that down for me, please?",
    "I think there is a mistake on the bill.", "The swimming pool is free for children on Sundays.",
    "My {relative} is a very good cook, but I can only make pasta.", "Would you like to come to dinner on {weekday}?",
]
EN_FILLS = {
    "shop": ["pharmacy", "bus stop", "bank", "post office", "bakery", "supermarket", "hospital", "cash machine",
             "bookshop", "metro station", "petrol station", "tourist office"],
    "room": ["double room", "single room", "room with a sea view", "quiet room", "family room"],
    "relative": ["sister", "brother", "cousin", "aunt", "uncle", "grandmother", "best friend", "neighbour"],
    "city": ["Paris", "Madrid", "Berlin", "Rome", "Lisbon", "Moscow", "Vienna", "Barcelona", "Milan", "Porto", "Lyon",
             "Munich"],
    "job": ["a nurse", "a teacher", "an engineer", "a chef", "a lawyer", "a photographer", "an architect",
            "a bus driver"],
    "period": ["week", "month", "summer", "weekend", "year"],
    "thing": ["jacket", "umbrella", "map", "ticket", "book", "bottle of wine", "watch", "bag"],
    "meal": ["dinner", "lunch", "breakfast", "soup", "fish"],
    "weekday": WEEKDAYS,
    "time": ["eight o'clock", "half past nine", "ten in the morning", "noon", "a quarter to six",
             "seven in the evening"],
    "document": ["report", "contract", "invoice", "presentation", "timetable"],
    "weather": ["very cold", "raining heavily", "extremely hot", "windy", "snowing"],
    "n": ["two", "three", "four", "five", "six"],
    "clothing": ["shirt", "dress", "pair of shoes", "coat", "jumper"],
    "symptom": ["bad cough", "high temperature", "sore throat", "headache", "stomach ache"],
    "landmark": ["church", "town hall", "traffic lights", "roundabout", "cathedral", "river"],
    "item": ["wallet", "passport", "phone", "umbrella", "scarf", "glasses"],
    "allergen": ["nuts", "milk", "eggs", "shellfish", "gluten"],
}
EN_MESSAGES = [
    "Hi! I arrived safely. The hotel is lovely and the weather is perfect. See you next week.",
    "Dear Ms Rossi, I have read the contract and have one question about the start date. Best regards.",
    "Hello, I'm interested in the flat you advertised. Is it still available, and when could I see it?",
    "Congratulations on your exam results! All that hard work paid off. Let's celebrate when I'm back.",
    "Sorry, I can't come to the meeting on Friday. Could we move it to Monday afternoon?",
    "Thank you so much for dinner last night. The food was amazing and we really enjoyed the evening.",
    "Good morning. My order arrived today, but one of the plates is broken. Could you send a replacement?",
    "Could you feed the cat while we're away? The keys are under the blue pot.",
    "We are delighted to invite you to our wedding on the twelfth of June. Please let us know if you can come.",
    "Hi, the printer at the office is broken again. Could you print the handouts at home?",
    "The school will be closed on Monday because of the storm. Lessons will start again on Tuesday.",
    "Could you tell me what documents I need to open a bank account? I am moving here next month.",
    "Thanks for looking after the cat last week. I brought you a small present from our trip.",
    "The plumber is coming tomorrow between nine and eleven. Can you be at home to let him in?",
    "I'm afraid the package was sent to my old address. Could you please redirect it to the new one?",
    "We have booked a cabin by the lake for the whole weekend. Bring your sister if she wants to come.",
    "Your application has been received. We will contact you within two weeks if you are selected for an interview.",
    "Please remember that the library will be closed for the holiday. All books can be returned after the fifth.",
    "Hi Anna, the train was delayed, so I'll arrive at around ten tonight. Don't wait up for me.",
    "Dear neighbours, we are having a small party on Saturday evening. Sorry in advance for any noise.",
    "The concert was incredible! The band played for almost three hours and the crowd sang every song.",
    "Could you send me the recipe for that lemon cake? Everyone at the office is still talking about it.",
    "I would like to change my phone plan from next month. Please confirm when this has been done.",
    "We're so proud of you for finishing your degree. Let's have dinner together to celebrate.",
    "The heating in my flat has not worked for three days. Could someone come and repair it this week?",
    "Welcome to the team! Your first day starts at nine, and I will meet you at the front desk.",
    "I'm writing to ask whether you have any rooms available for the first weekend of August.",
    "Thank you for your patience. Your refund has been processed and should appear in five working days.",
    "Let's meet at the café near the station at four. I'll be the one with the red umbrella.",
    "My flight lands at half past six. Could you pick me up at the airport, or should I take a taxi?",
]
TO_TEMPLATES = [
    "Translate into {L}: \"{s}\"", "How do you say \"{s}\" in {L}?", "Please translate this sentence into {L}: {s}",
    "Translate the following into {L}, and explain any words that are tricky:\n\n{s}",
    "Can you translate this into {L} in a formal tone? \"{s}\"", "Give me an informal {L} translation of: \"{s}\"",
    "I'm travelling to {country} next month. How would I say this in {L}? \"{s}\"",
    "Translate \"{s}\" into {L} and give a word-by-word breakdown.", "What's the {L} for this: \"{s}\"",
    "Translate into {L}, then explain the grammar of your translation: \"{s}\"",
    "Give me two ways to say \"{s}\" in {L}, one formal and one casual.",
]
MESSAGE_TEMPLATES = [
    "Translate this message into {L} so I can send it to a friend:\n\n{s}",
    "Please translate the following text into {L}:\n\n{s}", "Could you put this into natural {L}?\n\n{s}",
    "I need this in {L} for a colleague in {country}:\n\n{s}",
]


def english_sentence(rng: random.Random) -> str:
    return rng.choice(EN_SENTENCES).format(**{k: rng.choice(v) for k, v in EN_FILLS.items()})


@family("translation", "english-to-foreign", weight=5)
def translate_to(rng):
    lang = rng.choice(sorted(LANGUAGES))
    template = rng.choice(TO_TEMPLATES + (["Translate into Russian and add a transliteration in Latin letters: \"{s}\""]
                                          if lang == "Russian" else []))
    return template.format(L=lang, s=english_sentence(rng), country=rng.choice(LANGUAGES[lang]))


@family("translation", "english-message-to-foreign", weight=1.5)
def translate_message(rng):
    lang = rng.choice(sorted(LANGUAGES))
    return rng.choice(MESSAGE_TEMPLATES).format(L=lang, s=rng.choice(EN_MESSAGES), country=rng.choice(LANGUAGES[lang]))


FOREIGN_SENTENCES = {
    "French": [
        "Je voudrais essayer cette veste en taille moyenne.", "Est-ce qu'il y a une boulangerie près de l'hôtel ?",
        "Il fait très beau aujourd'hui, alors nous allons nous promener au parc.",
        "Pourriez-vous m'indiquer le chemin du musée ?", "Ma cousine apprend à jouer du piano depuis trois ans.",
        "Nous avons raté le dernier train et nous avons dû prendre un taxi.",
        "Est-ce que le petit-déjeuner est compris ?", "J'apprends le français parce que je veux vivre à Lyon.",
        "Le magasin ferme à dix-neuf heures le samedi.",
        "Les enfants jouent dans le jardin pendant que leurs parents préparent le dîner.",
        "Je suis désolé, mais je ne peux pas venir à la fête samedi.",
        "Ce livre est beaucoup plus intéressant que le film.",
    ],
    "Spanish": [
        "¿A qué hora cierra la biblioteca los sábados?", "Me gustaría reservar una habitación doble para tres noches.",
        "Ayer cenamos en casa de unos amigos.", "Mi hermana vive en Sevilla y trabaja en un banco.",
        "¿Podría traernos la cuenta, por favor?", "Hace mucho calor hoy; no olvides beber agua.",
        "El tren sale a las ocho y media de la mañana.", "Llevo dos años aprendiendo español.",
        "Perdone, ¿cuánto cuesta esta camisa?", "Tenemos que comprar un regalo para mi madre.",
        "Los niños están jugando en el parque con sus amigos.",
        "Si tienes tiempo mañana, podemos tomar un café juntos.",
    ],
    "German": [
        "Wo kann ich hier Fahrkarten kaufen?", "Ich hätte gern ein Stück Apfelkuchen, bitte.",
        "Am Wochenende besuchen wir unsere Großeltern auf dem Land.", "Können Sie mir bitte ein Taxi rufen?",
        "Meine Tante hat einen kleinen Garten hinter dem Haus.", "Die Bibliothek öffnet erst um zehn Uhr.",
        "Ich lerne Deutsch, weil ich in Berlin studieren möchte.", "Entschuldigung, wie viel kostet diese Jacke?",
        "Wir müssen morgen sehr früh aufstehen.", "Heute Abend gehen wir mit Freunden ins Kino.",
        "Ich brauche eine neue Brille, weil ich schlecht sehe.", "Kannst du mir bitte das Salz geben?",
    ],
    "Italian": [
        "Mi può consigliare un buon ristorante qui vicino?", "Vorrei un caffè e un cornetto, per favore.",
        "Ieri sera abbiamo mangiato in un piccolo ristorante vicino al mare.",
        "Mia madre insegna matematica in una scuola superiore.", "Può chiamarmi un taxi, per favore?",
        "Il treno per Firenze parte dal binario tre.", "Studio l'italiano da un anno perché amo la cucina italiana.",
        "Quanto costa questa borsa?", "Oggi fa freddo, quindi mettiti il cappotto.", "Questo autobus va in centro?",
        "I bambini giocano in giardino mentre i genitori preparano la cena.",
        "Domani dobbiamo alzarci presto per prendere l'aereo.",
    ],
    "Portuguese": [
        "Onde posso alugar uma bicicleta?", "Eu gostaria de reservar um quarto para duas noites.",
        "Ontem fomos à praia e almoçamos num restaurante de peixe.",
        "Minha irmã trabalha como engenheira numa empresa de energia.", "Você pode me mostrar o caminho até o museu?",
        "Quanto custa esta mochila?", "Hoje está muito quente, então leve um chapéu.",
        "Estou aprendendo português há seis meses.", "Vamos jantar na casa dos meus pais no domingo.",
        "As crianças estão brincando no parque com os amigos.", "Preciso comprar pão antes de voltar para casa.",
        "Desculpe, este lugar está ocupado?",
    ],
    "Russian": [
        "Как пройти к ближайшей аптеке?", "Я хотел бы поменять деньги. Где здесь банк?",
        "Мы живём в этом городе уже десять лет.", "Мой брат недавно купил новую машину.",
        "Не могли бы вы вызвать мне такси?", "Сколько стоит эта книга?", "Сегодня очень холодно, надень тёплую куртку.",
        "Я изучаю русский язык уже два года.", "Поезд отправляется в семь часов утра.", "Извините, я не понял вопрос.",
        "Дети играют во дворе, пока родители готовят ужин.", "Нам нужно купить подарок для бабушки.",
    ],
}
FROM_TEMPLATES = [
    "Translate this {L} sentence into English: \"{s}\"", "What does \"{s}\" mean in English?",
    "Can you translate this from {L} and explain the grammar? \"{s}\"",
    "Translate to English and give a word-by-word gloss: \"{s}\"",
    "A friend sent me this in {L}: \"{s}\" What does it say?", "Translate from {L} into English, keeping the tone: {s}",
    "I saw this sign written in {L}: \"{s}\" What does it mean?", "Translate this {L} sentence into {L2}: \"{s}\"",
]


@family("translation", "foreign-to-english", weight=1.2)
def translate_from(rng):
    lang = rng.choice(sorted(FOREIGN_SENTENCES))
    other = rng.choice(sorted(set(LANGUAGES) - {lang}))
    return rng.choice(FROM_TEMPLATES).format(L=lang, L2=other, s=rng.choice(FOREIGN_SENTENCES[lang]))


@family("translation", "phrase-explanation", weight=0.6)
def translate_phrases(rng):
    lang = rng.choice(sorted(LANGUAGES))
    topic = rng.choice(["ordering food in a restaurant", "asking for directions", "checking into a hotel",
                        "going to the doctor", "shopping at a market", "small talk with neighbours", "a job interview",
                        "taking a taxi", "talking about the weather", "making a phone call", "introducing yourself",
                        "writing a formal email"])
    return rng.choice([f"Give me ten useful {lang} phrases for {topic}, with English translations.",
                       f"I'm a beginner in {lang}. Teach me how to handle {topic}, with example sentences and "
                       "translations.",
                       f"Write a short dialogue in {lang} about {topic}, followed by an English translation."])


# ======================================================================================= summarisation
# Each topic is a list of sentences in reading order; a passage is the first sentence plus an ordered
# subset of the rest, 60-150 words, with {fills} drawn per passage.
PASSAGES = {
    "swimming-pool-hours": [
        "The public swimming pool in {city} will open at 6 a.m. on weekdays from the start of {month}, the city "
        "council announced on {weekday}.",
        "Until now, the pool has opened at 9 a.m., which many residents said made it impossible to swim before work.",
        "The change follows a survey in which {pct}% of the {big} people who responded asked for earlier opening.",
        "To pay for the extra lifeguards, the council will move money from a budget that was set aside for new signs "
        "and banners.",
        "Staff say the early sessions will be reserved for lane swimming, with beginners' lessons moved to the "
        "afternoon.",
        "Some councillors questioned whether the pool would be busy enough at dawn to justify the cost.",
        "The council has promised to review visitor numbers after six months and to adjust the hours if needed.",
        "Weekend opening times will not change, and the children's splash sessions will continue on Saturdays.",
        "Pool manager {name} {surname} said the decision showed that the council listens to the people who use its "
        "services.",
    ],
    "school-journeys-study": [
        "A study of primary schools in {city} found that children who walk or cycle to school concentrate better in "
        "morning lessons than those who arrive by car.",
        "Researchers observed {big} pupils aged seven to eleven and gave them short attention tests at 9 a.m. every "
        "day for a month.",
        "Children who had been active on the way to school scored on average {small} points higher on the tests.",
        "The effect was strongest on cold, bright mornings and had faded by lunchtime.",
        "Teachers also reported that these pupils settled into lessons more quickly.",
        "The researchers point out that families who walk may differ in other ways, such as living closer to school.",
        "Several schools in the study have since started 'walking buses', in which volunteers lead groups of children "
        "along a set route.",
        "Dr {surname}, who led the project, said that even a ten-minute walk seemed to make a difference.",
    ],
    "scooter-launch": [
        "{company} has launched a foldable electric scooter aimed at commuters who combine cycle paths with public "
        "transport.",
        "The scooter weighs {small} kilograms, folds in about three seconds and can travel up to {mid} kilometres on a "
        "single charge.",
        "It will go on sale in {month} at a price that the company says is lower than most of its competitors.",
        "The battery can be removed and charged at a desk, which the designers say solves a common complaint from "
        "office workers.",
        "Early reviewers praised the build quality but said the small wheels make rough roads uncomfortable.",
        "The company also promised that spare parts will be available for at least seven years to make repairs easier.",
        "Safety groups welcomed the built-in lights and indicators but reminded riders that helmets are still strongly "
        "recommended.",
        "{company} plans to sell the scooter in {small} countries by the end of next year.",
    ],
    "tool-library": [
        "A group of neighbours in {city} has opened a tool library, where members can borrow equipment instead of "
        "buying it.",
        "The idea started when {name} {surname} realised that most people on the street owned a drill they used "
        "only a few times a year.",
        "Today the library has more than {big} items, from ladders and saws to sewing machines and tents.",
        "Members pay a small yearly fee and can borrow up to three items at once for a week.",
        "Volunteers check and repair every tool when it comes back, and they run free repair workshops on "
        "Saturdays.",
        "The organisers say the project saves money, reduces waste and helps neighbours get to know each other.",
        "Similar libraries are now being planned in two other parts of the city.",
    ],
    "bike-lanes": [
        "{city} has opened {small} kilometres of new protected bike lanes along some of its busiest roads.",
        "The lanes are separated from traffic by low concrete kerbs and have their own traffic lights at major "
        "junctions.",
        "In the first month, the number of cyclists on these roads rose by {pct}%, according to automatic counters.",
        "Some shop owners had worried that removing parking spaces would hurt their business.",
        "A survey by the local chamber of commerce found mixed results, with cafés reporting more customers and some "
        "other shops fewer.",
        "Drivers have complained about longer journey times during the morning rush hour.",
        "The city says it will adjust the timing of traffic lights to reduce delays.",
        "Officials hope the lanes will help the city meet its goal of halving transport emissions by 2035.",
    ],
    "bees-pesticide": [
        "Scientists in {city} have found that low doses of a common pesticide can affect how well bumblebees find "
        "their way home.",
        "In the experiment, {big} bees were fitted with tiny radio tags and released about a kilometre from their "
        "nests.",
        "Bees exposed to the pesticide took on average {small} minutes longer to return, and fewer of them made it "
        "back at all.",
        "The doses used were similar to those bees might meet on farmland where treated crops are grown.",
        "Because colonies depend on foragers bringing back food, even small delays could weaken a nest over a season.",
        "The manufacturer said that laboratory tests do not reflect real conditions in the field.",
        "The researchers agree that larger field trials are needed but argue that the results justify caution.",
        "Bees pollinate many of the crops that people eat, so their decline worries farmers as well as "
        "conservationists.",
    ],
    "school-phone-ban": [
        "A secondary school in {city} has banned mobile phones during the school day, including at break and "
        "lunchtime.",
        "Students now hand in their phones at the start of the day and collect them at 3:30 p.m.",
        "The head teacher, {name} {surname}, said the rule was introduced after complaints about bullying and "
        "distraction in lessons.",
        "After one term, teachers report that students talk to each other more at lunch and that lessons start more "
        "calmly.",
        "Some parents were unhappy at first because they could not contact their children during the day.",
        "The school now passes on urgent messages through the reception desk.",
        "Students are divided: some say they feel less pressure, while others miss listening to music between classes.",
        "The school will publish data on attendance and grades at the end of the year to see whether the ban has made "
        "a difference.",
    ],
    "printing-press": [
        "In the middle of the fifteenth century, Johannes Gutenberg developed a printing press with movable metal type "
        "in Mainz.",
        "Before this, most books in Europe were copied by hand, which made them slow to produce and very expensive.",
        "Gutenberg's system let printers arrange individual letters, print many copies, and then reuse the letters for "
        "the next page.",
        "His most famous work, a Latin Bible, was printed around 1455, and fewer than fifty copies survive today.",
        "Within a few decades, printing workshops had spread to hundreds of towns across Europe.",
        "Cheaper books helped more people learn to read and allowed new ideas in science and religion to spread "
        "quickly.",
        "Historians often link the printing press to the Reformation and the Scientific Revolution.",
        "Printing itself was not new, however: it had existed in East Asia for centuries, using woodblocks and movable "
        "type.",
    ],
    "caves": [
        "Most large caves form in limestone, a rock that slowly dissolves in rainwater.",
        "As rain falls, it absorbs carbon dioxide from the air and soil, which turns it into a weak acid.",
        "The water seeps into cracks in the rock and, over thousands of years, widens them into passages and "
        "chambers.",
        "Underground rivers can carve long tunnels, and where the roof collapses, deep shafts called sinkholes "
        "appear.",
        "Inside the caves, dripping water leaves behind tiny amounts of minerals each time a drop falls.",
        "Over centuries these deposits grow into stalactites that hang from the ceiling and stalagmites that rise "
        "from the floor.",
        "Caves are home to specialised animals, such as blind fish and insects that never see daylight.",
        "Because they form so slowly, damaged cave formations can take thousands of years to recover.",
    ],
    "parks-survey": [
        "A survey of {big} residents in {city} asked how people use the city's public parks.",
        "Walking was the most common activity, mentioned by {pct}% of people, followed by meeting friends and "
        "exercising.",
        "Many parents said they visit parks mainly for the playgrounds and would like more shaded seating.",
        "Older residents asked for more benches and public toilets, saying these decide whether they can visit at "
        "all.",
        "Around a third of respondents said they feel unsafe in some parks after dark because of poor lighting.",
        "Young people wanted more sports courts and places to meet that are not shops or cafés.",
        "The council says it will use the results to decide how to spend its budget for parks over the next five "
        "years.",
    ],
    "ferry-story": [
        "For thirty years, {name} {surname} ran the little ferry that crossed the lake between two villages outside "
        "{city}.",
        "The boat was old and slow, and {he} knew every passenger by name.",
        "Children rode it to school, farmers carried their vegetables to market, and tourists took photos from the "
        "deck.",
        "When a new road bridge was built, the council announced that the ferry would no longer be needed.",
        "On the last day, more people came to ride the ferry than ever before, and nobody wanted to get off.",
        "The villages held a party on the jetty, and {he} was given a painting of the boat.",
        "A year later, a group of volunteers restored the ferry and now run it on summer weekends.",
        "{He} still sits at the front on every trip and tells visitors stories about the lake.",
    ],
    "lost-dog": [
        "A dog that went missing during a storm in {city} has been found {mid} kilometres away, three weeks after it "
        "disappeared.",
        "The dog, a shy rescue named {dog}, ran off when a tree fell near its owners' garden.",
        "Its owners put up posters, shared photos online and searched the woods every evening after work.",
        "A farmer eventually spotted the dog sleeping in a barn and recognised it from a post on a local community "
        "page.",
        "A microchip confirmed the dog's identity, and the owners drove out the same night to collect it.",
        "Vets say the dog was thin but otherwise healthy, probably surviving on scraps and water from streams.",
        "The family thanked the hundreds of strangers who shared their posts and joined the search.",
        "Animal charities are using the story to remind owners to keep their microchip details up to date.",
    ],
    "mangrove-restoration": [
        "Mangrove forests grow along tropical coastlines, where their tangled roots stand in salty water.",
        "They protect the shore from storms and waves and provide nurseries for many kinds of fish.",
        "Over recent decades, large areas of mangroves have been cleared for farms, ports and housing.",
        "In a project near the coast, local villagers have replanted more than {mid} thousand seedlings over "
        "{small} years.",
        "At first many seedlings died, because they were planted where the tides did not reach properly.",
        "The team changed its approach and restored the natural flow of water before planting again.",
        "Fishermen say their catches have improved since the young forest began to grow.",
        "Scientists note that mangroves also store large amounts of carbon in their mud, which helps to slow "
        "climate change.",
    ],
    "project-meeting": [
        "The project team met on {weekday} to review progress on the new customer website.",
        "The design work is finished, and developers have completed about {pct}% of the pages.",
        "Testing found problems with the payment page on older phones, which will be fixed by the end of next week.",
        "The launch date has moved back by two weeks because the content team needs more time to write product "
        "descriptions.",
        "{name} raised concerns about the budget, since the extra weeks will add to contractor costs.",
        "The team agreed to drop the live chat feature from the first release and add it later in the year.",
        "Marketing will prepare an email campaign to announce the launch once the date is confirmed.",
        "At the next meeting, in two weeks, the team will decide whether the site is ready to go live.",
    ],
    "e-reader-review": [
        "The new {company} e-reader is light enough to hold in one hand for hours, and its screen is easy to read "
        "even in bright sunlight.",
        "Pages turn quickly, and the adjustable warm light makes reading in bed more comfortable.",
        "The battery lasted about {small} weeks in our tests with half an hour of reading a day.",
        "The built-in store is easy to use, but loading your own books from a computer is more awkward than it "
        "should be.",
        "The device is waterproof, so it can safely be used in the bath or by a pool.",
        "There are no physical page-turn buttons, which some readers will miss.",
        "At its current price, it is good value for people who read a lot and want a simple device.",
        "Overall, we recommend it, especially for travellers who want to carry a whole library in a small bag.",
    ],
    "theatre-reopening": [
        "The Royal Theatre in {city} reopened on {weekday}, {small} years after a fire destroyed its roof and "
        "stage.",
        "Builders restored the painted ceiling and the red velvet seats using old photographs as a guide.",
        "Behind the scenes, the theatre now has modern lighting, a larger stage and better access for disabled "
        "visitors.",
        "The first performance was a comedy written by a local playwright about the night of the fire.",
        "More than {big} people applied for tickets to the opening night, far more than the theatre could seat.",
        "The restoration was paid for partly by the council and partly by thousands of small donations.",
        "The director said the theatre wants to attract younger audiences with cheaper tickets on weekday evenings.",
    ],
    "water-shortage": [
        "Authorities in the region around {city} have introduced water restrictions after the driest spring in {mid} "
        "years.",
        "Households are banned from using hoses to water gardens or wash cars until further notice.",
        "Reservoirs are at {pct}% of their normal level for this time of year.",
        "Farmers warn that some crops may fail if there is no significant rain in the next month.",
        "The water company says it is repairing leaks faster, but critics point out that a large share of water is "
        "still lost through old pipes.",
        "Residents are being encouraged to take shorter showers and to reuse water from washing vegetables on their "
        "plants.",
        "Experts say droughts like this are likely to become more common and call for long-term investment in storage "
        "and recycling.",
    ],
    "scientist-profile": [
        "Dr {name} {surname} grew up in a small village outside {city}, where {he} spent hours studying insects in the "
        "fields.",
        "{He} was the first person in {his} family to go to university, where {he} studied biology.",
        "In {his} thirties, {he} discovered that a common type of beetle larva could break down certain plastics.",
        "At first, other scientists doubted the results, and two journals rejected {his} paper.",
        "{He} repeated the experiments with a larger team and published the findings several years later.",
        "Today, companies are testing whether enzymes from the larvae can be used to recycle plastic waste.",
        "{He} also runs a programme that brings school pupils from rural areas into the laboratory each summer.",
        "{He} says curiosity and stubbornness have been more useful in {his} career than talent.",
    ],
    "history-of-tea": [
        "Tea has been drunk in China for thousands of years, first as a medicine and later as an everyday drink.",
        "By the time of the Tang dynasty, tea culture had developed its own tools, rituals and famous writings.",
        "Buddhist monks carried tea to Japan, where it became the centre of a carefully practised ceremony.",
        "European traders began importing tea in the seventeenth century, and it quickly became fashionable in "
        "Britain.",
        "The demand for tea had major economic effects, including trade imbalances and conflicts between Britain and "
        "China.",
        "In the nineteenth century, the British established large tea plantations in India and Sri Lanka.",
        "Today, tea is the most widely drunk beverage in the world after water.",
        "Black, green, white and oolong teas all come from the same plant but are processed in different ways.",
    ],
    "stadium-plans": [
        "{city} United football club has revealed plans for a new stadium on the site of an old railway yard.",
        "The stadium would hold about {big} more fans than the current ground, which was built more than a century "
        "ago.",
        "The club says the move would allow it to earn more money and compete with bigger teams.",
        "The plans include a new train station, shops and several hundred homes around the stadium.",
        "Many supporters are excited, but some feel the old ground is an important part of the club's history.",
        "Residents near the site are worried about noise and traffic on match days.",
        "A public consultation will run until {month}, and the council will decide on the plans next year.",
    ],
    "harbour-swim": [
        "More than {big} swimmers crossed the harbour in {city} on {weekday} in an open-water race raising money "
        "for the local lifeboat service.",
        "The course was about one and a half kilometres long, from the old fish market to the lighthouse steps.",
        "Water temperatures were just {small} degrees above the minimum allowed, and many swimmers wore wetsuits.",
        "The fastest swimmer, {name} {surname}, finished in under twenty-five minutes.",
        "Safety boats and kayakers followed the swimmers, and two people were helped out of the water with cramp.",
        "Spectators lined the harbour wall and cheered as each swimmer reached the steps.",
        "Organisers said the event raised more than last year, though the final total is still being counted.",
        "Entries for next year's swim open in {month}.",
    ],
    "postal-strike": [
        "Postal workers in the region will walk out for two days next week in a dispute over changes to delivery "
        "rounds.",
        "The union says new rounds are too long and that staff are being asked to carry heavier loads.",
        "Management says the changes are needed because people send fewer letters but order more parcels.",
        "Letters posted during the strike will be delayed by up to a week, while some parcel services will "
        "continue.",
        "Businesses that rely on post, such as small online shops, have been advised to warn their customers.",
        "Pharmacies are working with doctors to make sure prescriptions sent by post still arrive on time.",
        "Both sides say they are open to talks, but no meeting has yet been arranged.",
    ],
    "food-waste-bins": [
        "From {month}, households in {city} will have a separate bin for food waste, collected every week.",
        "The council says that food currently makes up about a third of what goes into general rubbish bins.",
        "The collected food will be taken to a plant that turns it into biogas and fertiliser for local farms.",
        "General waste will be collected every two weeks instead of every week to encourage people to recycle more.",
        "Some residents worry about smells, especially in summer and in flats with little outdoor space.",
        "The council will provide free compostable bags and small kitchen caddies to every household.",
        "Similar schemes in other cities have raised recycling rates and reduced the amount of rubbish sent to "
        "landfill.",
    ],
    "internet-packets": [
        "When you send a message over the internet, it is broken into small pieces of data called packets.",
        "Each packet carries the address of its destination, much like an envelope in the post.",
        "Devices called routers pass the packets from one network to another, choosing a path that seems fastest at "
        "that moment.",
        "Packets from the same message can take different routes and arrive out of order.",
        "The receiving computer uses numbers on each packet to put the message back together correctly.",
        "If a packet goes missing, protocols such as TCP ask for it to be sent again.",
        "This design makes the internet resilient, because traffic can flow around broken links or busy areas.",
        "It was developed in the 1960s and 1970s partly to build networks that could survive damage to individual "
        "parts.",
    ],
    "choir-story": [
        "The town choir in {city} had sung at every wedding and funeral for forty years, but its members were "
        "growing old.",
        "When a young newcomer named {name} joined, the others were delighted, until they heard {him} sing.",
        "{He} sang loudly, enthusiastically and almost never in tune.",
        "Nobody had the heart to tell {him}, so the conductor quietly moved {him} to the back row.",
        "Over the following months, {name} came to every rehearsal early and stayed late to put away the chairs.",
        "Slowly, with the help of an elderly soprano, {his} singing began to improve.",
        "At the spring concert, {he} sang a short solo, and the audience stood up to applaud.",
        "The choir now has twelve new members, most of whom say they joined because of {name}.",
    ],
    "solar-farm": [
        "Plans for a large solar farm on farmland near {city} have been approved after a two-year planning process.",
        "The site will cover about {big} hectares and produce enough electricity for roughly {mid} thousand homes.",
        "Supporters say the project will cut emissions and bring money into the area through rent paid to landowners.",
        "Opponents argued that good farmland should be used for food and that the panels would spoil the view.",
        "As a compromise, sheep will graze between the rows of panels, and hedges will be planted to screen the site.",
        "The developer has also promised to fund a community energy scheme that lowers bills for nearby villages.",
        "Construction is expected to begin next year and take about eighteen months.",
    ],
    "complaint-letter": [
        "I am writing to complain about an order I placed on your website on {weekday} {day} {month}.",
        "I ordered a kitchen table and four chairs, which were supposed to be delivered within five working days.",
        "After two weeks, only the chairs arrived, and one of them had a cracked leg.",
        "I have called your customer service line three times and was promised a call back each time, but nobody has "
        "contacted me.",
        "I have now paid in full for furniture that I cannot use, and I had to borrow a table for a family gathering.",
        "I would like the table to be delivered within the next week and the damaged chair to be replaced.",
        "If this is not possible, I expect a full refund for the whole order.",
        "I look forward to your reply and hope we can resolve this quickly.",
    ],
    "reading-aloud-study": [
        "Reading aloud to young children for just fifteen minutes a day can greatly expand their vocabulary, according "
        "to new research.",
        "The study followed {big} families with children aged two to five over eighteen months.",
        "Children who were read to every day knew, on average, hundreds more words by the end of the study.",
        "The benefits were similar whether parents read picture books, stories or non-fiction.",
        "Talking about the pictures and asking questions seemed to help even more than reading the text straight "
        "through.",
        "The researchers stress that it is never too early to start, even with babies who cannot yet speak.",
        "They also suggest that libraries and nurseries could help families who do not have many books at home.",
    ],
    "raft-race": [
        "The small town of {town} held its annual raft race last weekend, with thousands of visitors lining the "
        "river banks.",
        "Teams built their rafts from barrels, planks and old bicycle parts, and many dressed in fancy costumes.",
        "A team of local firefighters won the race for the third year in a row.",
        "Several rafts sank within metres of the start, to loud cheers from the crowd.",
        "Food stalls along the river sold pies, ice cream and drinks throughout the afternoon.",
        "Organisers said the event raised money to repair the footbridge in the town centre.",
        "Some residents complained about traffic and parking, and the council is considering a shuttle bus for next "
        "year.",
    ],
    "new-timetable": [
        "From next term, Hillside Secondary School in {city} will start lessons at 9:15 a.m. instead of 8:40 a.m.",
        "The school says the change follows advice that teenagers concentrate better later in the morning.",
        "To keep the same amount of teaching time, lunch will be fifteen minutes shorter and the day will end at "
        "3:45 p.m.",
        "Breakfast club will still open at 8 a.m. for families who need to drop children off early.",
        "Bus companies have agreed to adjust their routes so that pupils can arrive on time.",
        "Some parents worry that the later finish will clash with after-school jobs and activities.",
        "The head teacher, {name} {surname}, said the school will review the new timetable after one year.",
    ],
    "beavers-return": [
        "Beavers have been released into a river valley near {city} for the first time in centuries, as part of a "
        "wildlife project.",
        "The animals were hunted to extinction in the area long ago for their fur and scent glands.",
        "Supporters say beavers build dams that slow down rivers, which can reduce flooding in towns downstream.",
        "The ponds they create also provide homes for insects, frogs, birds and fish.",
        "Some farmers are worried that the dams could flood fields or block drainage ditches.",
        "The project has agreed to remove or lower any dam that causes damage to farmland.",
        "Rangers will follow the beaver family with hidden cameras over the next few years.",
    ],
}
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
SURNAMES = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Alvarez", "Novak", "Brennan", "Haddad", "Kowalski", "Mensah",
            "Ferreira", "Iyer", "Castillo", "Nakamura", "Petrov", "O'Neill", "Abara", "Rossi", "Fischer", "Duarte"]
COMPANIES = ["Northwind", "Bluepeak", "Harbor & Vale", "Tessellate", "Greenfield", "Lumen Labs", "Orbit Mobility",
             "Fieldstone", "Kestrel", "Brightwater"]
TOWNS = ["Little Brampton", "Westerholm", "Kirkby Lane", "Saint-Aubin", "Alder Creek", "Marlow End", "Oakhurst"]
DOG_NAMES = ["Biscuit", "Luna", "Pepper", "Otto", "Maple", "Scout", "Juniper", "Rolo"]


def passage(rng: random.Random, topic: str) -> str:
    """A 60-150 word passage: the topic's first sentence and an ordered subset of the rest, pools filled in."""
    lines = PASSAGES[topic]
    name, he, him, his = person(rng)
    fills = dict(city=rng.choice(CITIES), name=name, he=he, him=him, his=his, He=he.capitalize(),
                 surname=rng.choice(SURNAMES), company=rng.choice(COMPANIES), month=rng.choice(MONTHS),
                 weekday=rng.choice(WEEKDAYS), day=rng.randint(1, 28), pct=rng.randint(12, 75),
                 small=rng.randint(3, 12), mid=rng.randint(15, 95), big=rng.randint(15, 95) * 10,
                 town=rng.choice(TOWNS), dog=rng.choice(DOG_NAMES))
    while True:
        rest = sorted(rng.sample(range(1, len(lines)), rng.randint(3, len(lines) - 1)))
        text = " ".join(lines[i] for i in [0] + rest).format(**fills)
        if 60 <= len(text.split()) <= 150:
            return text


SUMMARY_INSTRUCTIONS = [
    "Summarise this passage in one sentence:\n\n{p}", "Summarize the following text in three bullet points.\n\n{p}",
    "Give me a short summary of this for a ten-year-old:\n\n{p}",
    "Write a headline and a two-sentence summary for this article:\n\n{p}", "TL;DR this:\n\n{p}",
    "Summarise the key points of the following passage, then say which one you think matters most.\n\n{p}",
    "Condense this into about 30 words:\n\n{p}",
    "Can you summarise this for a busy manager? Two or three sentences at most.\n\n{p}",
    "Read the passage below and summarise it in your own words.\n\n{p}",
    "Turn this into a summary short enough for a social media post:\n\n{p}",
    "What is the main idea of this passage? Explain briefly.\n\n{p}",
    "Summarise this in a short paragraph, then list two questions a reader might still have.\n\n{p}",
    "Here's a passage from {source}. Summarise it in plain language:\n\n{p}",
    "Give a one-paragraph summary and three keywords for this text:\n\n{p}",
    "{p}\n\nSummarise the text above in two sentences.", "Summarise this for a student revising for a test:\n\n{p}",
    "Write a summary of this passage in exactly three sentences.\n\n{p}",
    "Please shorten this to its essential facts:\n\n{p}",
    "Extract the main facts from this passage as a bulleted list:\n\n{p}",
    "In one sentence, what happened here?\n\n{p}",
    "Write an abstract-style summary, about 50 words, of this text:\n\n{p}",
    "{p}\n\nCan you give me the gist of this in a few bullet points?",
    "Summarise the passage below, and then explain who it would matter to and why.\n\n{p}",
    "Please give me a neutral summary of this, without adding opinions:\n\n{p}",
]
SOURCES = ["a local newspaper", "a company newsletter", "a science magazine", "a school newsletter", "a blog",
           "a council press release", "a textbook", "a review website"]


def _summary_of(topic: str) -> Family:
    def make(rng):
        return rng.choice(SUMMARY_INSTRUCTIONS).format(p=passage(rng, topic), source=rng.choice(SOURCES))
    return make


for _topic in PASSAGES:
    family("summarisation", _topic)(_summary_of(_topic))


# =============================================================================== instruction_following
IF_TOPICS = [
    "the benefits of walking meetings", "why hobbies matter for students", "the history of the umbrella",
    "how to make a good cup of tea", "the rock cycle", "learning to cook as an adult",
    "the pros and cons of social media", "a perfect picnic", "the importance of wetlands",
    "how to prepare for a long hike", "the future of high-speed trains", "why people enjoy scary films",
    "the life of a forest ranger", "a trip to the mountains", "how the internet changed shopping",
    "the benefits of reading fiction", "city life versus country life", "how to start a vegetable garden",
    "the role of museums today", "recycling at home", "the first day at a new school", "how sand dunes form",
    "cooking for friends", "why exercise improves mood", "working night shifts", "the invention of the telephone",
    "protecting ocean wildlife", "saving money as a student", "the rules of badminton", "what makes a good teacher",
    "the value of team sports", "space exploration", "coffee culture around the world",
    "learning to play a musical instrument", "how to reduce food waste", "a snowy morning in a village",
    "the importance of voting", "public libraries", "the history of the Olympic Games", "how aeroplanes fly",
    "the life cycle of a butterfly", "artificial intelligence in everyday life", "why people keep pets",
    "how to learn to juggle", "tidal power", "a day in the life of a nurse", "birdwatching for beginners",
    "the history of chocolate", "digital privacy", "the benefits of volunteering", "how to write a good story",
    "climate change and farming", "the evolution of video games", "photography for beginners", "slow travel",
    "the power of habits", "board games", "surviving a long flight", "the first flight across the Atlantic",
    "street food", "why trees matter in cities", "the benefits of learning to knit",
    "the history of the printing press", "how to be a good friend", "spring cleaning", "mountain villages",
    "a small town bakery", "time management",
]
IF_PRODUCTS = ["a bamboo toothbrush", "a solar-powered phone charger", "a folding camping chair", "a smart plant pot",
               "noise-cancelling earplugs", "a handmade wooden jewellery box", "a language-learning app",
               "a weighted blanket", "an electric kettle with temperature control", "a waterproof picnic blanket",
               "a budget fitness tracker"]
IF_EMAILS = [("my landlord", "a broken heater"), ("my manager", "changing my working hours"),
             ("a customer", "a product recall"), ("my neighbours", "a party I'm planning"),
             ("my child's teacher", "an upcoming absence"), ("a hiring manager", "following up after an interview"),
             ("my team", "a change in the meeting schedule"), ("a hotel", "an early check-in"),
             ("a friend", "a hiking trip next month")]
IF_TOPIC_TASKS = [
    "Write a short essay about {t}.", "Write a blog post about {t}.", "Write a paragraph about {t}.",
    "Write a short article on {t}.", "Give an overview of {t}.", "Write a short speech about {t}.",
    "Write a letter to a friend about {t}.", "Write a poem about {t}.", "Write a school-newsletter piece on {t}.",
    "Write a social media post about {t}.", "Describe {t} to a child.", "Write a short guide to {t}.",
]
IF_PRODUCT_TASKS = ["Write a product description for {p}.", "Write an advertisement for {p}.", "Write a review of {p}.",
                    "Write a pitch to investors for {p}."]
IF_EMAIL_TASKS = ["Write an email to {who} about {what}.", "Draft a polite message to {who} about {what}.",
                  "Write a short note to {who} regarding {what}."]
IF_KEYWORDS = ["balance", "journey", "community", "future", "simple", "energy", "curious", "window", "river",
               "patience", "garden", "signal", "morning", "bridge", "quiet", "courage", "network", "harvest", "pocket",
               "lantern"]
IF_END_PHRASES = ["Is there anything else I can help with?", "That is all for today.",
                  "Let me know if you have additional questions.",
                  "Thank you for reading.", "Any other questions?", "See you next time."]
IF_START_WORDS = ["Imagine", "Today", "Honestly", "First", "Picture", "Yes", "Well", "Listen"]
IF_FOREIGN = ["Spanish", "French", "German", "Italian", "Portuguese"]


def quoted_list(words: list[str], conjunction: str) -> str:
    """'a', 'b' and 'c'."""
    quoted = [f"'{w}'" for w in words]
    return f"{', '.join(quoted[:-1])} {conjunction} {quoted[-1]}"


def _c_length(rng):
    n = rng.choice([40, 50, 60, 80, 100, 120, 150])
    return rng.choice([f"Your response must be fewer than {n} words.", f"Use at least {n * 2} words.",
                       f"Keep the response between {n} and {n + 50} words.", f"Answer in no more than {n} words.",
                       f"Your answer must contain exactly {rng.randint(3, 6)} sentences."])


IF_CONSTRAINTS = {
    "length": _c_length,
    "bullets": lambda rng: rng.choice([f"Your answer must contain exactly {rng.randint(3, 7)} bullet points, using "
                                       "markdown bullets such as '* point'.",
                                       f"Format the answer as a numbered list of exactly {rng.randint(3, 8)} items.",
                                       f"Use exactly {rng.randint(3, 6)} bullet points and nothing else."]),
    "case": lambda rng: rng.choice(["Your entire response must be in lowercase letters; no capital letters are "
                                    "allowed.",
                                    "Your entire response must be in English and in capital letters only.",
                                    "Write everything in lowercase, including the first word of each sentence."]),
    "keywords": lambda rng: "Include the keywords {} in your response.".format(
        quoted_list(rng.sample(IF_KEYWORDS, rng.randint(2, 3)), "and")),
    "keyword_freq": lambda rng: f"The word '{rng.choice(IF_KEYWORDS)}' should appear at least {rng.randint(2, 4)} "
                                "times.",
    "forbidden": lambda rng: "Do not use the words {} anywhere in your response.".format(
        quoted_list(rng.sample(["very", "really", "good", "important", "thing", "nice", "great", "just"], 2), "or")),
    "no_commas": lambda rng: rng.choice(["Do not use any commas in your response.",
    "Your entire response must not contain a single comma."]),
    "end_phrase": lambda rng: f"Finish your response with the exact phrase \"{rng.choice(IF_END_PHRASES)}\" and no "
                              "other words after it.",
    "start_word": lambda rng: f"The first word of your response must be '{rng.choice(IF_START_WORDS)}'.",
    "json": lambda rng: rng.choice(["Wrap your entire output in JSON format. You can use markdown ticks such as ```.",
                                    "Return the answer as a JSON object with the keys \"title\" and \"body\", and "
                                    "nothing else.",
                                    "Your whole response must be valid JSON."]),
    "paragraphs": lambda rng: f"There should be exactly {rng.randint(2, 5)} paragraphs, separated from each other by "
                              "the markdown divider ***.",
    "title": lambda rng: "Give your answer a title wrapped in double angular brackets, such as <<my title>>.",
    "quotes": lambda rng: "Wrap your entire response in double quotation marks.",
    "postscript": lambda rng: "At the end of your response, add a postscript starting with "
                              f"{rng.choice(['P.S.', 'P.P.S.'])}",
    "highlight": lambda rng: f"Highlight at least {rng.randint(2, 4)} sections of your answer with markdown, for "
                             "example *highlighted section*.",
    "placeholders": lambda rng: f"Include at least {rng.randint(2, 4)} placeholders in square brackets, such as "
                                "[address].",
    "sections": lambda rng: f"Your response must have {rng.randint(2, 4)} sections. Mark the beginning of each section "
                            "with 'SECTION X'.",
    "two_responses": lambda rng: "Give two different responses, separated by six asterisks: ******.",
    "letter_freq": lambda rng: f"The letter '{rng.choice('bdkmpwy')}' should appear at least {rng.randint(5, 15)} "
                               "times in your response.",
    "end_question": lambda rng: "End your response with a question for the reader.",
    "language": lambda rng: f"Respond only in {rng.choice(IF_FOREIGN)}; no other language is allowed.",
    "no_exclamation": lambda rng: "Do not use any exclamation marks.",
}
_CONFLICT_PAIRS = {
    "json": ["bullets", "paragraphs", "title", "quotes", "postscript", "highlight", "sections", "two_responses",
    "end_phrase",
             "start_word", "end_question", "no_commas", "length", "case", "placeholders", "letter_freq"],
    "bullets": ["paragraphs", "sections", "two_responses", "length"],
    "case": ["language", "start_word", "end_phrase", "keywords", "keyword_freq", "title", "placeholders", "sections"],
    "language": ["keywords", "keyword_freq", "forbidden", "start_word", "end_phrase", "letter_freq", "postscript",
    "sections"],
    "quotes": ["end_phrase", "start_word", "two_responses", "end_question", "postscript"],
    "postscript": ["end_phrase", "end_question"],
    "end_phrase": ["end_question", "two_responses"],
    "two_responses": ["paragraphs", "sections", "title", "start_word", "end_question", "length"],
    "paragraphs": ["sections"],
}
IF_CONFLICTS = {c: set() for c in IF_CONSTRAINTS}
for _a, _bs in _CONFLICT_PAIRS.items():
    for _b in _bs:
        IF_CONFLICTS[_a].add(_b)
        IF_CONFLICTS[_b].add(_a)


def with_constraints(rng: random.Random, task: str) -> str:
    """The task followed by one to three mutually compatible verifiable constraints."""
    chosen: list[str] = []
    for _ in range(rng.choice([1, 1, 2, 2, 2, 3, 3])):
        options = [c for c in IF_CONSTRAINTS if c not in chosen and not IF_CONFLICTS[c] & set(chosen)]
        chosen.append(rng.choice(options))
    rules = [IF_CONSTRAINTS[c](rng) for c in chosen]
    if len(rules) > 1 and rng.random() < 0.3:
        return task + " Follow these rules:\n" + "\n".join(f"- {r}" for r in rules)
    return sentences(task, *rules)


@family("instruction_following", "topic-task", weight=5)
def if_topic(rng):
    return with_constraints(rng, rng.choice(IF_TOPIC_TASKS).format(t=rng.choice(IF_TOPICS)))


@family("instruction_following", "product-task", weight=1.5)
def if_product(rng):
    return with_constraints(rng, rng.choice(IF_PRODUCT_TASKS).format(p=rng.choice(IF_PRODUCTS)))


@family("instruction_following", "email-task", weight=1.5)
def if_email(rng):
    who, what = rng.choice(IF_EMAILS)
    return with_constraints(rng, rng.choice(IF_EMAIL_TASKS).format(who=who, what=what))


# ================================================================================================ main
def generate() -> list[dict]:
    """PER_DOMAIN prompts per domain, families drawn by weight; duplicates and reserved clashes are redrawn."""
    clash = reserved_filter()
    seen: set[str] = set()
    records: list[dict] = []
    for domain in DOMAINS:
        rng = random.Random(f"{SEED}:{domain}")
        names = list(FAMILIES[domain])
        weights = [FAMILIES[domain][n][1] for n in names]
        count = draws = 0
        while count < PER_DOMAIN:
            draws += 1
            if draws > PER_DOMAIN * MAX_TRIES_PER_PROMPT:
                raise RuntimeError(f"{domain}: only {count} distinct prompts after {draws - 1} draws")
            name = rng.choices(names, weights)[0]
            prompt = FAMILIES[domain][name][0](rng)
            key = normalise(prompt)
            if key in seen or clash(prompt):
                continue
            seen.add(key)
            records.append({"domain": domain, "prompt": prompt, "source": f"template:{domain}/{name}",
                            "licence": LICENCE})
            count += 1
    random.Random(f"{SEED}:order").shuffle(records)
    return [{"id": f"distill-{i:05d}", **r} for i, r in enumerate(records)]


def length_table(records: list[dict]) -> str:
    """A markdown table of prompt counts and lengths (characters) per domain."""
    rows = ["| domain | prompts | mean chars | min | max |", "|---|---:|---:|---:|---:|"]
    for domain in DOMAINS + ("all",):
        lengths = [len(r["prompt"]) for r in records if domain in ("all", r["domain"])]
        mean = statistics.mean(lengths)
        rows.append(f"| {domain} | {len(lengths):,} | {mean:.0f} | {min(lengths)} | {max(lengths)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output JSONL (default: {DEFAULT_OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    records = generate()
    check_disjoint_all([r["prompt"] for r in records])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    print(f"wrote {len(records):,} prompts to {args.out}")
    print(length_table(records))


if __name__ == "__main__":
    main()
