"""The validation toolkit every reader of user input uses: `Fields` and the number readers.

A reader takes one mapping (a scenario section, a config file, a request body) and a dotted path;
every bad value becomes one `FieldError` naming the field and what is allowed (``wan.rate: '10' has no
rate unit; use ...``), which the CLI prints as one line with exit status 2. Value parsers (here and in
`testbed.units`) raise ``ValueError``; `Fields.get` adds the field name. Nothing here knows a scenario.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Callable, TypeVar

from testbed import units
from testbed.errors import FieldError, UserError

__all__ = ["MAX_NAME_BYTES", "MAX_RUNS", "MAX_SEED", "REQUIRED", "CONGESTION_CONTROL_NAME_MAX", "FieldError", "Fields", "at_least_one", "boolean", "comma_list", "congestion_control", "count_up_to", "integers",
           "load_yaml", "mapping", "name_or_stem", "non_negative", "not_a_folder", "number", "option", "output_file_option", "path_exists", "path_option", "path_is_dir",
           "path_is_file", "path_name", "plain_name", "planned_runs", "whole_number", "digits_python_reads", "positive_number", "random_seed",
           "read_json", "read_text", "read_yaml", "run_count", "shown", "string", "text", "yaml_problem"]

T = TypeVar("T")
REQUIRED: Any = object()  # `Fields.get(..., default=REQUIRED)`: the key must be there
# The longest name that a file's or directory's name is built from (a scenario's, an experiment arm's, a cross-traffic
# flow's): 200 bytes of UTF-8. A file or directory name is at most 255 bytes (NAME_MAX on ext4, xfs, btrfs, tmpfs); the
# most the testbed adds to one is 25 bytes to a scenario's (prfaas capacity's default folder
# runs/capacity-<name>-YYYYmmdd-HHMMSS; a run directory runs/<name>-YYYYmmdd-HHMMSS adds 16) and
# ".<period>.server.json" to a flow's (its iperf3 logs), so 200 leaves room for both and a later suffix. A
# 300-character scenario name passed `prfaas check`, then `prfaas run` died on OSError "File name too long" (2026-12-07).
MAX_NAME_BYTES = 200
NAME_MAX_BYTES = 255  # a file or folder name's most bytes (NAME_MAX on ext4, xfs, btrfs, tmpfs): what `_some_path` checks
# The largest random seed: 2**32 - 1, a range every consumer of a seed takes with the offsets the testbed adds (a WAN
# direction's delay line seed + 1 and + 2, a profiling batch's seed + i): random.Random and numpy's SeedSequence take any
# whole number >= 0, torch.manual_seed one below 2**64 (past it "Overflow when unpacking long long": `seed: 10**400`
# passed the scenario reader and failed a torch run's workers, 2026-12-07), numpy's legacy RandomState one below 2**32,
# an int64 parquet column (an experiment's `seed`) one below 2**63, and JSON read by a browser is exact below 2**53.
# 4.29 billion seeds are more than any experiment runs. Scenarios, workload and model sections, experiment specs and
# every --seed option read a seed with `random_seed`.
MAX_SEED = 2**32 - 1
# The most runs one command may plan: 10,000. A run takes a minute or more of wall time -- its workers' start-up, the
# workload (the scenario's duration), the drain and the teardown: 27 s beyond the duration measured on the 2-core VM
# (experiments.reproduce.RUN_OVERHEAD_S; 45-s quick runs took 61-92 s) -- so 10,000 runs are about a week one after
# another (6.9 days at a minute each; a week is the longest duration the testbed takes, units.MAX_DURATION_S), and still
# days on a cluster: past any study made here. Every count that plans runs is read with `run_count` (an experiment's
# `seeds` count and `repetitions`, `--repetitions` and `--max-probes` of `prfaas capacity`, `reproduce --repetitions`),
# and what the counts plan together with `planned_runs` (an experiment's arms x seeds x repetitions, a sweep's grid, a
# capacity search's rates x repetitions, a reproduction's searches and paired test). `seeds: 100000000` built a
# 10^8-seed list and then checked every run's scenario, hours before the first run (2026-12-07).
MAX_RUNS = 10_000
_RUNS_WHY = "the most runs one command may plan (validation.MAX_RUNS: about a week of one-minute runs)"


class Fields:
    """Reads one mapping (a scenario section, a config, a request body), naming every bad value by its dotted path.

    ``f.get("rate", units.parse_rate_bps)`` parses or raises `FieldError("wan.rate", ...)`;
    ``f.done()`` refuses keys nobody read, listing the allowed ones.
    """

    def __init__(self, data: Any, path: str = "", source: str | None = None, document: str = "top level") -> None:
        """`document`: what a whole file that is no mapping is called in the refusal (``scenario``; a model spec, an
        experiment spec or a profile said "scenario:" too until 2026-12-07)."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise FieldError(path or document, f"must be a mapping of keys to values, got {type(data).__name__}", source)
        self.data = data
        self.path = path
        self.source = source
        self._read: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, message: str) -> FieldError:
        return FieldError(self.name(key), message, self.source)

    def has(self, key: str) -> bool:
        return key in self.data

    def mark_read(self, *keys: str) -> None:
        """Keys read some other way (e.g. by a parser given the raw data): `done()` will not refuse them."""
        self._read.update(keys)

    def get(self, key: str, parse: Callable[[Any], T], default: Any = REQUIRED) -> T:
        self._read.add(key)
        if key not in self.data or self.data[key] is None:
            if default is REQUIRED:
                raise self.error(key, "is required")
            return default
        try:
            return parse(self.data[key])
        except FieldError:
            raise
        except (ValueError, TypeError) as exc:
            raise self.error(key, str(exc)) from None

    def choice(self, key: str, allowed: tuple[str, ...] | list[str], default: Any = REQUIRED) -> str:
        def parse(v: Any) -> str:
            if str(v) not in allowed:
                raise ValueError(f"{v!r} is not allowed; use one of: {', '.join(allowed)}")
            return str(v)

        return self.get(key, parse, default)

    def section(self, key: str) -> "Fields":
        self._read.add(key)
        return Fields(self.data.get(key), self.name(key), self.source)

    def items(self, key: str) -> list["Fields"]:
        """A list of mappings, each read as `Fields` named ``key[i]``."""
        self._read.add(key)
        raw = self.data.get(key)
        if raw is None:
            raw = []
        if not isinstance(raw, list):  # an empty mapping, string or 0 is not an empty list either
            raise self.error(key, f"must be a list, got {type(raw).__name__}")
        return [Fields(v, f"{self.name(key)}[{i}]", self.source) for i, v in enumerate(raw)]

    def done(self) -> None:
        unknown = sorted(set(map(str, self.data)) - self._read)
        if unknown:
            import difflib

            allowed = ", ".join(sorted(self._read)) or "(none)"
            near = difflib.get_close_matches(unknown[0], sorted(self._read), n=1)  # a typo: `worklaod`, `block_hash`
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise self.error(unknown[0], f"unknown key; {hint}allowed keys here: {allowed}")


def whole_number(v: Any) -> int:
    """A whole number >= 0, not a bool (`positive_int` until 2026-12-07, a name that promised > 0; `at_least_one` is
    the reader of counts that must be >= 1)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{v!r} is not a whole number >= 0")
    return v


def shown(v: Any) -> str:
    """`v` as a message shows it: a whole number of 21 digits or more by its length, a string of more than 200
    characters by its first 60 and its length (a 5000-character model name was echoed whole, 2026-12-07)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**20:
        return f"a {len(str(abs(v)))}-digit number"
    if isinstance(v, str) and len(v) > 200:
        return f"{v[:60]!r}... ({len(v)} characters)"
    return repr(v)


def random_seed(v: Any) -> int:
    """A random seed: a whole number from 0 to `MAX_SEED` (not a bool)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_SEED:
        raise ValueError(f"{shown(v)} is not a seed; use a whole number from 0 to {MAX_SEED} (2**32 - 1)")
    return v


def at_most(read: Callable[[Any], T], most: float, unit: str = "", why: str = "") -> Callable[[Any], T]:
    """`read`, then at most `most` (`unit` follows the bound, `why` says why no more): a value's bound where its reader
    has none (a protocol field, a command-line option). A count is `count_up_to`'s."""

    def check(v: Any) -> T:
        x = read(v)
        if x > most:  # type: ignore[operator]
            bound = most if isinstance(most, int) else f"{most:g}"
            raise ValueError(f"{shown(v)} is more than {bound}" + (f" {unit}" if unit else "") + (f", {why}" if why else ""))
        return x

    return check


def at_least_one(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{v!r} is not a whole number >= 1")
    return v


def count_up_to(most: int, why: str = "") -> Callable[[Any], int]:
    """A reader of a count: a whole number from 1 to `most` (`why`, when given, says why no more: it follows the
    refusal). The one bounded count: runs (`run_count`), iperf3 streams, a profile's batch and GPUs."""

    return at_most(at_least_one, most, why=why)


run_count = count_up_to(MAX_RUNS, _RUNS_WHY)
run_count.__doc__ = "A count that plans runs (seeds, repetitions, rates to try): a whole number from 1 to `MAX_RUNS`."


def planned_runs(runs: int, how: str) -> int:
    """`runs`, what a command's counts plan together (`how` says how, e.g. "3 arms x 5000 seeds x 1 repetition"), when
    at most `MAX_RUNS`; else a ValueError saying so."""
    if runs > MAX_RUNS:
        raise ValueError(f"{how} make {shown(runs)} runs, more than {MAX_RUNS}, {_RUNS_WHY}")
    return runs


def path_name(name: str, names: str) -> str:
    """`name` when it can be (part of) one file's or directory's name, which `names` says (for the message): no '/',
    '\\' or NUL, not '.' or '..', Unicode text (no lone surrogate) and at most `MAX_NAME_BYTES` bytes of UTF-8."""
    if "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain name (it names {names}); use letters, digits, '-', '_' or '.', without '/'")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise ValueError(f"{name!r} is not valid Unicode text (a lone surrogate); it names {names}") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"{name[:24]!r}... is {size} bytes long; a name is at most {MAX_NAME_BYTES} bytes (it names {names}, "
                         f"and a file or directory name is at most {NAME_MAX_BYTES})")
    return name


def plain_name(v: Any, names: str) -> str:
    """A name given in a file (a scenario's, an experiment's): a non-empty string (a whole number reads as one) that
    `path_name` takes; `names` says what it names. ``name: [1, 2]`` ran as "[1, 2]" when names were read with `str`."""
    return path_name(text(str(v) if isinstance(v, int) and not isinstance(v, bool) else v), names)


def name_or_stem(f: Fields, names: str, fallback: str) -> str:
    """The ``name`` that `f` (a file's mapping) gives (`plain_name`), else its file's name without the extension
    (`f.source`'s stem; `fallback` without a file) read the same way: a file's name that cannot be a name -- longer
    than `MAX_NAME_BYTES`, a lone surrogate from bytes that are not UTF-8 -- is one `FieldError` naming the file and
    saying to add ``name:`` (it was used unchecked, and a 250-byte file name made runs/<name>-<time> too long)."""
    if f.has("name") and f.data["name"] is not None:
        return f.get("name", lambda v: plain_name(v, names))
    f.mark_read("name")
    stem = Path(f.source).stem if f.source else fallback
    try:
        return plain_name(stem, names)
    except ValueError as exc:
        raise f.error("name", f"not given, and the file's name cannot stand for it: {exc}; add name: <a plain name> to the "
                              "file") from None


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{v!r} is not true or false")
    return v


def number(v: Any) -> float:
    return units.finite_number(v, "a number")


def positive_number(v: Any) -> float:
    x = number(v)
    if x <= 0:
        raise ValueError(f"{v!r} must be > 0")
    return x


def text(v: Any) -> str:
    """A non-empty string."""
    if not isinstance(v, str) or not v:
        raise ValueError(f"{v!r} is not a non-empty string")
    return v


# Linux's TCP_CA_NAME_MAX: 16 bytes with the closing NUL, so a TCP congestion control's name is at most 15
# characters (setsockopt TCP_CONGESTION and iperf3 -C copy no more).
CONGESTION_CONTROL_NAME_MAX = 15


def congestion_control(v: Any) -> str:
    """A TCP congestion control's name as Linux spells it (`cubic`, `bbr`, `reno`, ...): a lowercase letter, then
    lowercase letters, digits or '_', at most `CONGESTION_CONTROL_NAME_MAX` characters. The one reader of
    serving.kv_congestion_control and cross_traffic.flows[].congestion (this one reaches iperf3's command line:
    '-x' was read as an option, 2026-12-07). Whether this kernel has it is asked when a run is planned."""
    if not isinstance(v, str) or not re.fullmatch(rf"[a-z][a-z0-9_]{{0,{CONGESTION_CONTROL_NAME_MAX - 1}}}", v):
        raise ValueError(f"{v!r} is not a congestion control's name (lowercase letters, digits and '_', at most "
                         f"{CONGESTION_CONTROL_NAME_MAX} characters): use one this kernel has, e.g. cubic, bbr or reno "
                         "(sysctl net.ipv4.tcp_available_congestion_control)")
    return v


def string(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{v!r} is not a string")
    return v


def integers(v: Any) -> tuple[int, ...]:
    """A list of whole numbers (not booleans), as a tuple."""
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError("must be a list of integers")
    return tuple(v)


def mapping(v: Any) -> dict[str, Any]:
    """A JSON object / YAML mapping, copied."""
    if not isinstance(v, dict):
        raise ValueError(f"must be an object, got {type(v).__name__}")
    return dict(v)


def non_negative(v: Any) -> float:
    x = number(v)
    if x < 0:
        raise ValueError(f"{v!r} must be >= 0")
    return x


def digits_python_reads() -> int:
    """The most digits Python reads in a whole number (4300 unless PYTHONINTMAXSTRDIGITS or `sys.set_int_max_str_digits`
    says otherwise): past it `int()` and `json.loads` raise ValueError, a traceback wherever a file was read."""
    import sys

    return sys.get_int_max_str_digits()


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that a key given twice in one mapping is a `yaml.YAMLError` naming both lines:
    PyYAML keeps the last silently, so a second ``threshold:`` a few lines down replaced the first unseen; and data
    nested deeper than Python's recursion limit is a `yaml.YAMLError` too ("nested too deeply"), and so is a whole number
    past the digits Python reads (`digits_python_reads`)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then a key of base: an override, not a repeat
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice in one mapping (first at line {first.line + 1}); keep one",
                        key_node.start_mark)
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node: Any) -> Any:
            try:
                return super().construct_yaml_int(node)
            except ValueError:  # past Python's digits: a ValueError traceback wherever YAML is read (`seed: 1000...`)
                raise yaml.constructor.ConstructorError(None, None, f"a whole number of {len(node.value)} characters, more than "
                                                        f"the {digits_python_reads()} digits Python reads", node.start_mark) from None

    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)
    except RecursionError:  # `seed: [[[[...` hundreds deep: a traceback before, wherever YAML is read
        raise yaml.YAMLError("nested too deeply") from None


def yaml_problem(exc: Exception) -> str:
    """What a `yaml.YAMLError` says is wrong, in one line: a ReaderError (a NUL byte, a control character) has no
    `problem`, and its text runs over two lines (``--set name=<NUL>`` printed both, 2026-12-08)."""
    return getattr(exc, "problem", None) or str(exc).splitlines()[0]


def _path_test(path: Path | str, test: Callable[[Path], bool]) -> bool:
    """`test(Path(path))`, except that a name no file can have (longer than the system allows, a NUL byte) is simply
    not there: `Path.exists` and its kin raised OSError (ENAMETOOLONG) or ValueError, a traceback for a typo."""
    try:
        return test(Path(path))
    except (OSError, ValueError):
        return False


def path_exists(path: Path | str) -> bool:
    """`Path.exists`, with `_path_test`'s reading of an impossible name."""
    return _path_test(path, Path.exists)


def path_is_dir(path: Path | str) -> bool:
    """`Path.is_dir`, with `_path_test`'s reading of an impossible name (a 5000-character run directory was an
    ENAMETOOLONG traceback in `prfaas report`)."""
    return _path_test(path, Path.is_dir)


def path_is_file(path: Path | str) -> bool:
    """`Path.is_file`, with `_path_test`'s reading of an impossible name."""
    return _path_test(path, Path.is_file)


def read_text(path: Path, what: str) -> str:
    """A text file a user names (or a run directory holds), as `read_yaml` and `read_json` read theirs: one that cannot
    be read (a directory, no permission) or is not UTF-8 text is one line naming it; `what` says what is expected."""
    try:
        return path.read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (at byte offset {exc.start}); {what} is expected") from None


def read_yaml(path: Path, what: str) -> Any:
    """A YAML file's data (the one reader of user YAML files): a file that cannot be read (a directory, no
    permission, not UTF-8 text), a syntax error or a key given twice becomes one line naming the file, and the
    line where it can; `what` says what the file should be (``"a scenario (...)"``). A file that holds no data -- empty,
    only blank lines and comments, or ``null`` -- is refused too, as `read_json` refuses an empty file: no YAML file
    the testbed reads means anything empty, and each reader took it as an empty mapping, its defaults (`prfaas traffic
    generate` of an empty workload file drew the default workload, exit 0; 2026-12-07)."""
    import yaml

    text = read_text(path, what)
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = yaml_problem(exc)
        if getattr(exc, "position", None) is not None and not mark:
            where = f" at character {exc.position + 1}"
        raise UserError(f"{path}: not valid YAML{where} ({problem})") from None
    if data is None:
        raise UserError(f"{path}: {'empty' if not text.strip() else 'no data (only comments, or null)'}; {what} is expected")
    return data


def read_json(path: Path, what: str = "a JSON file") -> Any:
    """A JSON file's data (the one reader of JSON files a user names or a run directory holds), as `read_yaml` reads
    YAML: a file that cannot be read, is not UTF-8 text, is not valid JSON or is nested too deeply is one line naming
    the file, and the line where it can (an empty file is said to be empty). ``NaN`` and ``Infinity`` read as floats (Python's `json.dumps` writes them:
    a summary of a run with no finished request has them); the reader of each field refuses them where a number is
    needed. `what` says what the file should be (``"a summary (summary.json)"``)."""
    import json

    text = read_text(path, what)
    if not text.strip():  # a file cut to nothing (a full disk, an editor killed): "Expecting value at line 1" says less
        raise UserError(f"{path}: empty; {what} is expected")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); {what} is expected") from None
    except RecursionError:
        raise UserError(f"{path}: not {what} (JSON nested too deeply)") from None
    except ValueError:  # a whole number past the digits Python reads: a ValueError traceback before
        raise UserError(f"{path}: not {what} (a number of more than {digits_python_reads()} digits)") from None


def comma_list(text: str, option: str, example: str = "") -> list[str]:
    """A command-line option's comma-separated values (`--policies prfaas,fixed-threshold`, `--grid seed=1,2`), each
    without its spaces; every comma-list option reads its values here. No value at all, or an empty one -- two commas
    in a row, or one at either end: a value left out or a comma too many -- is a `UserError` naming `option` (and
    `example`, a list it takes): ``--policies: 'prfaas,,fixed-threshold' has an empty value (two commas in a row, or one
    at an end); give each value``. Until 2026-12-07 only `--grid` refused an empty value: `quickstart --policies`,
    `reproduce --only` and `wall --lengths` dropped it without a word, and a benchmark's `--seeds 1,,2` was a ValueError
    traceback."""
    values = [v.strip() for v in text.split(",")]
    eg = f", e.g. {example}" if example else ""
    if values == [""]:
        raise UserError(f"{option}: give at least one value (separated by commas{eg})")
    if "" in values:
        raise UserError(f"{option}: {text!r} has an empty value (two commas in a row, or one at an end); give each value{eg}")
    return values


def path_option(text: str) -> str:
    """A command-line option that names a folder (`--out DIR`): an empty name is refused, as argparse refuses a
    bad number (``argument --out: '' is no path; name a file or folder``). `--out ""` was taken as "no --out": `capacity`
    started its runs in the default folder, `experiment` wrote into the current one. An option that names a file the
    command writes is `output_file_option`."""
    return _some_path(text, "a file or folder")


def _some_path(text: str, names: str) -> str:
    """`text` when it can name a path: not blank, no NUL byte, no part past `NAME_MAX_BYTES` (the last two were a
    ValueError and an OSError traceback where the path was first used, e.g. `lab start --dir`, 2026-12-08)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is no path; name {names}")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{shown(text)} holds a NUL byte, which no path can; name {names}")
    longest = max(text.split("/"), key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > NAME_MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{shown(longest)} is {len(os.fsencode(longest))} bytes, and a file or folder name is at "
                                         f"most {NAME_MAX_BYTES}; name {names}")
    return text


def not_a_folder(path: Path | str) -> tuple[Path, str] | None:
    """The first of `path` and the folders above it that is there but is no folder, and what it is ("a file", "a link
    to nowhere"): what stands where a folder goes. None when there is none (each is a folder or is not there)."""
    for q in (Path(path), *Path(path).parents):
        if _path_test(q, lambda p: os.path.lexists(p)) and not path_is_dir(q):
            return q, "a link to nowhere" if not path_exists(q) else "a file"
    return None


def output_file_option(text: str) -> Path:
    """A command-line option that names a file the command writes (`--json FILE`, `--out FILE`, `--telemetry FILE`),
    as its argparse `type=`: refused in one line before any work when no file can be written there -- no name, a
    folder (``argument --json: 'runs' is a folder; name a file``), a link to nowhere or a device, pipe or socket (the
    testbed writes a file by renaming a new one over it: /dev/null would be replaced), or a folder to hold it that is
    not there, is no folder or cannot be written. The folder is not made: a typo in its name is refused, not taken as
    a new folder. `prfaas calibrate --json DIR` and `net up --telemetry DIR` found the folder once the network had run,
    and lost what they measured; `profile --out` had its own check (2026-12-07)."""
    path = Path(_some_path(text, "a file"))
    if path_is_dir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file")
    if text.endswith("/"):  # Path drops the '/': "new/" would have been written as the file new
        raise argparse.ArgumentTypeError(f"{text!r} ends in '/', as a folder's name does; name a file")
    if len(os.fsencode(path.name)) > MAX_NAME_BYTES:  # 243-255 bytes failed once the work was done: the new file is
        # written as NAME.<8 hex>.tmp first (testbed.atomic), past the file system's 255 (2026-12-07)
        raise argparse.ArgumentTypeError(f"{text[:60]!r}...: the file's name is {len(os.fsencode(path.name))} bytes; at most "
                                         f"{MAX_NAME_BYTES} (the testbed writes it under a longer temporary name first)")
    if _path_test(path, lambda p: os.path.lexists(p)) and not path_is_file(path):
        what = "a link to nowhere" if not path_exists(path) else "no plain file (a device, pipe or socket)"
        raise argparse.ArgumentTypeError(f"{text!r} is {what}; name a file")
    if not path_is_dir(path.parent):
        blocker = not_a_folder(path.parent)
        if blocker:
            raise argparse.ArgumentTypeError(f"{text!r}: {blocker[0]} is {blocker[1]} where a folder goes")
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {path.parent} does not exist; make it first (or name a file "
                                         f"in another folder)")
    if not os.access(path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: no file can be made in the folder {path.parent} (no permission, or a "
                                         f"read-only file system)")
    return path


def option(parse: Callable[[Any], T], whole: bool = False) -> Callable[[str], T]:
    """A command-line option's argparse `type=`: the text read as a whole number (`whole`) or a number, then checked
    by one of the readers above, so a CLI option and a scenario field refuse a value in the same words. argparse
    prints a refusal as one line naming the option (``argument --tolerance: nan is not a number``), exit status 2."""

    def read(text: str) -> T:
        try:
            value: Any = int(text) if whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole number' if whole else 'number'}") from None
        try:
            return parse(value)
        except ValueError as exc:  # the readers name the value as read (0.0, inf); say it as typed (0, 1e400)
            why = str(exc)
            raise argparse.ArgumentTypeError(text + why[len(repr(value)):] if why.startswith(repr(value)) else why) from None

    read.__name__ = parse.__name__
    return read
