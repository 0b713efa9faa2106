"""Where the labs are and what each folder holds.

A lab is a folder ``labs/labN-<slug>/`` with ``lab.yaml`` (number, title, minutes of machine time, the
answers file the handout names, the files a student copies), ``handout.md``, ``questions.md``, scenario
files and an answers template. The folders travel with the package (package data), so ``prfaas lab``
finds them from any working directory.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from testbed.atomic import make_output_dir
from testbed.errors import UserError

LABS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Lab:
    number: int
    slug: str
    title: str
    minutes: float  # machine time of the handout's commands on a 2-core host
    point: str  # the one thing the lab teaches
    answers: str  # answers file name (in the student's lab directory)
    files: tuple[str, ...]  # what `prfaas lab start` copies
    folder: Path

    @property
    def handout(self) -> Path:
        return self.folder / "handout.md"

    @property
    def default_dir(self) -> str:
        return f"lab{self.number}"


def _read(folder: Path) -> Lab:
    meta = yaml.safe_load((folder / "lab.yaml").read_text())
    return Lab(int(meta["number"]), folder.name.split("-", 1)[1], str(meta["title"]), float(meta["minutes"]), str(meta["point"]),
               str(meta["answers"]), tuple(meta["files"]), folder)


def list_labs() -> list[Lab]:
    return sorted((_read(d) for d in LABS_DIR.glob("lab*-*") if (d / "lab.yaml").is_file()), key=lambda lab: lab.number)


def get_lab(number: int) -> Lab:
    labs = list_labs()
    for lab in labs:
        if lab.number == number:
            return lab
    raise UserError(f"lab {number}: no such lab; labs: {', '.join(str(x.number) for x in labs)} (prfaas lab list)")


def start_lab(lab: Lab, dest: Path, *, force: bool = False) -> list[Path]:
    """Copy the lab's student files into `dest` (scenarios, questions, answers template, scripts) and make
    its ``runs/`` folder. Every check comes before the first copy, and ``runs/`` is made (`make_output_dir`) before it
    too: a file of the lab already there (the student's answers, or a scenario they edited) is not overwritten unless
    `force`; a link or folder where a file goes, and a link or file where ``runs/`` goes, are refused even with it.
    (Until 2026-12-07 only the answers file was guarded; a link was written through, to a file outside the folder; a
    folder took the file inside it; a file named runs was a FileExistsError traceback.)"""
    names = lab.files + ("handout.md",)
    runs = dest / "runs"

    def check() -> None:
        for name in names:
            p = dest / name
            if p.is_symlink() or (p.exists() and not p.is_file()):
                raise UserError(f"{p}: a {'link' if p.is_symlink() else 'folder'} where the lab's file goes; move it aside")
        there = [name for name in names if (dest / name).exists()]
        if there and not force:
            raise UserError(f"{dest / there[0]} exists already ({'your answers?' if lab.answers in there else 'edited?'}); "
                            "use another --dir, or --force to overwrite the lab's files")
        if runs.is_symlink():  # a link to a folder `make_dirs` would take: the lab's runs would land outside its folder
            raise UserError(f"{runs}: a link where the lab's runs folder goes; move it aside")

    make_output_dir(runs, check)  # a file in its place is refused there, naming it
    out = []
    for name in names:
        shutil.copy(lab.folder / name, dest / name)  # with its mode (measure.sh runs)
        out.append(dest / name)
    return out
