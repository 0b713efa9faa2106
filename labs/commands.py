"""``prfaas lab list | show N | start N | check N [RUN_DIR...]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from typing import TYPE_CHECKING

from testbed.errors import UserError
from testbed.validation import path_option

if TYPE_CHECKING:
    from labs.catalog import Lab


def register(sub: "argparse._SubParsersAction") -> None:
    lab = sub.add_parser("lab", help="teaching labs: list, read a handout, start one, check your answers against your runs")
    lsub = lab.add_subparsers(dest="lab_command", metavar="{list,show,start,check}")
    ls = lsub.add_parser("list", help="the labs, their machine time and the point each makes")
    ls.set_defaults(func=cmd_list)
    sh = lsub.add_parser("show", help="print a lab's handout")
    sh.add_argument("number", type=int, help="the lab's number (`prfaas lab list`)")
    sh.set_defaults(func=cmd_show)
    st = lsub.add_parser("start", help="copy a lab's scenarios, questions and answers template into a working folder")
    st.add_argument("number", type=int, help="the lab's number (`prfaas lab list`)")
    st.add_argument("--dir", type=path_option, help="where (default ./labN)")
    st.add_argument("--force", action="store_true", help="overwrite the lab's files already there (the answers, an edited scenario); never a link or folder where a file goes")
    st.set_defaults(func=cmd_start)
    ck = lsub.add_parser("check", help="recompute each answer from your runs and say which hold")
    ck.add_argument("number", type=int, help="the lab's number (`prfaas lab list`)")
    ck.add_argument("run_dirs", nargs="*", type=Path, metavar="RUN_DIR", help="default: the runs the answers file lists, under its runs/")
    ck.add_argument("--answers", type=Path, help="answers file (default: ./answers.yaml inside the lab folder, else ./labN/answers.yaml)")
    ck.set_defaults(func=cmd_check)
    lab.set_defaults(func=lambda a: (lab.print_help(), 2)[1])


def cmd_list(args: argparse.Namespace) -> int:
    from labs.catalog import list_labs

    for lab in list_labs():
        print(f"{lab.number}  {lab.title}  (~{lab.minutes:g} min of machine time)\n   {lab.point}")
    print("next: prfaas lab show 1")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from labs.catalog import get_lab

    print(get_lab(args.number).handout.read_text())
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from labs.catalog import get_lab, start_lab

    lab = get_lab(args.number)
    dest = Path(args.dir or lab.default_dir)
    for p in start_lab(lab, dest, force=args.force):
        print(f"wrote {p}")
    print(f"next: read {dest / 'handout.md'} (or `prfaas lab show {lab.number}`); your answers go in {dest / lab.answers}")
    return 0


def default_answers(lab: "Lab") -> Path:
    """``answers.yaml`` here when run inside the lab folder (as the handouts do), else ``labN/answers.yaml``."""
    here, below = Path(lab.answers), Path(lab.default_dir) / lab.answers
    if here.is_file() and (Path("runs").is_dir() or not below.is_file()):
        return here
    return below


def resolve_runs(answers: dict, answers_path: Path, given: list[Path]) -> dict[str, Path]:
    """Run directories by name: those given (named by folder, or by path where two folders share a name, as
    `prfaas experiment`'s ``runs/<arm>/seed1-rep1`` do), else the answers' ``runs:`` keys under runs/,
    else every run folder below runs/ (one holding scenario.yaml or check.json)."""
    from labs.checks import run_names

    if given:
        names = [p.name for p in given]
        return {(p.name if names.count(p.name) == 1 else str(p)): p for p in given}
    base = answers_path.parent / "runs"
    names = run_names(answers, str(answers_path))
    if names:
        return {n: base / n for n in names}
    if not base.is_dir():
        return {}
    found = sorted({f.parent for pat in ("scenario.yaml", "check.json") for f in base.rglob(pat)})
    return {str(p.relative_to(base)): p for p in found}


def cmd_check(args: argparse.Namespace) -> int:
    from labs.answers import load_answers
    from labs.catalog import get_lab
    from labs.checks import CHECKERS
    from testbed.validation import path_is_dir

    lab = get_lab(args.number)
    path = args.answers or default_answers(lab)
    answers = load_answers(path)
    runs = resolve_runs(answers, path, args.run_dirs)
    missing = [str(p) for p in runs.values() if not path_is_dir(p)]  # `Path.is_dir`: an OSError for a 5000-character name
    if missing:
        raise UserError(f"lab {lab.number}: run director{'y' if len(missing) == 1 else 'ies'} not found: {', '.join(missing)}")
    verdicts = CHECKERS[lab.number](answers, runs)
    for v in verdicts:
        print(f"{'holds' if v.holds else 'WRONG'}  {v.question}: {v.why}")
    bad = [v.question for v in verdicts if not v.holds]
    print(f"lab {lab.number}: {len(verdicts) - len(bad)} of {len(verdicts)} answers hold" + (f"; wrong: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0
