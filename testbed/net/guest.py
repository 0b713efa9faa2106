"""Run a command as root inside a qemu guest whose kernel has netem (for hosts whose kernel has not).

    bash scripts/guest-kernel.sh [--kernel VMLINUZ] [--mem 2G] [--cpus 2] [--accel auto|kvm|tcg]
                                 [--out DIR]... [--timeout S] [--verbose] -- CMD...

Who knows what: `find_kernel` picks a distribution kernel whose modules (with `sch_netem`) the host
filesystem carries; `module_order` reads its `modules.dep`; `build_initramfs` writes a busybox
initramfs (a pure-Python cpio, so no root or mknod is needed) whose `/init` mounts the host's root over
9p read-only, puts a tmpfs overlay on it, shares the project directory and each `--out` directory
writable, switches root to that overlay, loads the testbed's modules and runs CMD there; `qemu_argv` is the qemu command
line; `run_guest` runs it, streams CMD's output (a virtio console on qemu's stdout), kills qemu in all
cases and returns CMD's exit status.

Accelerator: `auto` uses KVM only when a short probe boot (this same guest running `true`) finishes
within `KVM_PROBE_TIMEOUT_S`; on the build machines `/dev/kvm` exists but a KVM guest hangs, so the
answer is cached per host boot in /run/prfaas/guest-accel.json. Otherwise TCG (`-cpu max`: the
default TCG CPU lacks instructions the virtualenv's wheels use).

stdlib only: `scripts/guest-kernel.sh` runs it with the system python3, before or without a venv.
Exit status: CMD's; 124 when `--timeout` expired; 125 when the guest could not run CMD; 2 for bad
options.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT = 124
EXIT_GUEST_FAILED = 125
KVM_PROBE_TIMEOUT_S = 10.0
ACCEL_CACHE = Path("/run/prfaas/guest-accel.json")
BUSYBOX_PATHS = ("/bin/busybox", "/usr/bin/busybox")  # Debian's busybox-static; must be static
QEMU = "qemu-system-x86_64"
NINEP_OPTS = "trans=virtio,version=9p2000.L,msize=262144"

# Loaded from the initramfs, before the host's root is reachable: virtio PCI, 9p, overlay, console.
BOOT_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_console")
# Loaded with the host's modprobe once the root is mounted: what the testbed and Mininet use.
TESTBED_MODULES = (
    "sch_netem", "sch_htb", "sch_tbf", "sch_ingress", "sch_prio", "sch_fq", "ifb", "veth", "bridge",
    "act_mirred", "cls_u32", "cls_matchall", "nfnetlink_queue", "ip_tables", "iptable_filter",
    "iptable_mangle", "xt_NFQUEUE", "xt_comment", "xt_statistic", "xt_conntrack", "nf_conntrack",
    "tcp_bbr", "tun",
)
# Environment the guest does not inherit: the caller's session, desktop and test-runner plumbing.
_ENV_DROP = re.compile(r"^(PYTEST_|SSH_|DISPLAY$|XAUTHORITY$|DBUS_|WAYLAND_|INVOCATION_ID$|JOURNAL_STREAM$|NOTIFY_SOCKET$|LISTEN_|TMUX|TERMCAP$|OLDPWD$|PWD$|SHLVL$|_$)")


class GuestError(Exception):
    """The guest cannot start or cannot run the command; the message says why."""


# ----------------------------------------------------------------------------------------------- kernel


@dataclass(frozen=True)
class Kernel:
    image: Path
    version: str  # as in /lib/modules/<version>

    @property
    def modules_dir(self) -> Path:
        return Path("/lib/modules") / self.version


def bzimage_version(image: Path) -> str:
    """The kernel release string inside a bzImage (boot protocol: header at 0x202, version at 0x20e)."""
    with open(image, "rb") as f:
        head = f.read(0x210)
        if len(head) < 0x210 or head[0x202:0x206] != b"HdrS":
            raise GuestError(f"{image}: not a bzImage kernel (no boot header)")
        offset = int.from_bytes(head[0x20E:0x210], "little") + 0x200
        f.seek(offset)
        text = f.read(256).split(b"\0", 1)[0].decode(errors="replace")
    return text.split()[0]


PVH_NOTE = re.compile(rb"\x04\x00\x00\x00[\x04\x08]\x00\x00\x00\x12\x00\x00\x00Xen\x00")  # XEN_ELFNOTE_PHYS32_ENTRY
VMLINUX_CACHE = Path("/var/cache/prfaas/guest")
QBOOT = Path("/usr/share/qemu/qboot.rom")


def extract_vmlinux(image: Path) -> bytes | None:
    """The uncompressed ELF kernel inside a bzImage (xz or gzip payload), if it has a PVH entry point."""
    import lzma
    import zlib

    data = image.read_bytes()
    for magic, decompress in ((b"\xfd7zXZ\x00", lambda b: lzma.LZMADecompressor().decompress(b)),
                              (b"\x1f\x8b\x08", lambda b: zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(b))):
        at = data.find(magic)
        if at < 0:
            continue
        try:
            elf = decompress(data[at:])
        except (lzma.LZMAError, zlib.error):
            continue
        if elf[:4] == b"\x7fELF" and PVH_NOTE.search(elf):
            return elf
    return None


def boot_image(kernel: Kernel, cache_dir: Path = VMLINUX_CACHE) -> Path:
    """What qemu boots: the kernel's uncompressed ELF with its PVH entry (no firmware real mode, no
    decompression under TCG: boot to CMD took 8 s instead of 16 s here), cached per kernel image;
    the bzImage itself when it has no such payload (zstd, lz4) or the cache is not writable."""
    st = kernel.image.stat()
    cached = cache_dir / f"vmlinux-{kernel.version}-{st.st_size}-{int(st.st_mtime)}"
    if cached.is_file():
        return cached
    elf = extract_vmlinux(kernel.image)
    if elf is None:
        return kernel.image
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for old in cache_dir.glob(f"vmlinux-{kernel.version}-*"):
            old.unlink()
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(elf)
        tmp.rename(cached)
    except OSError:
        return kernel.image
    return cached


def _has_module(modules_dir: Path, name: str) -> bool:
    return any(modules_dir.glob(f"kernel/**/{name}.ko*"))


def find_kernel(explicit: str | None = None) -> Kernel:
    """--kernel VMLINUZ, else the newest /boot/vmlinuz-* whose modules include sch_netem."""
    if explicit:
        image = Path(explicit)
        if not image.is_file():
            raise GuestError(f"--kernel: {explicit} is not a file")
        version = bzimage_version(image)
        k = Kernel(image, version)
        if not k.modules_dir.is_dir():
            raise GuestError(f"--kernel: {image} is Linux {version}, but /lib/modules/{version} is missing on this host")
        return k
    candidates = []
    for image in sorted(Path("/boot").glob("vmlinuz-*")):
        version = image.name[len("vmlinuz-"):]
        if _has_module(Path("/lib/modules") / version, "sch_netem"):
            candidates.append(Kernel(image, version))
    if not candidates:
        raise GuestError("no guest kernel: no /boot/vmlinuz-* with sch_netem in /lib/modules "
                         "(install one: apt-get install linux-image-amd64, or run bash scripts/bootstrap.sh setup)")
    return max(candidates, key=lambda k: _version_key(k.version))


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.-]", version))


def module_order(modules_dir: Path, names: tuple[str, ...]) -> list[str]:
    """Relative paths (in modules.dep) to insmod, dependencies first, each once; built-ins are skipped."""
    deps: dict[str, list[str]] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
    builtin = set()
    builtin_file = modules_dir / "modules.builtin"
    if builtin_file.exists():
        builtin = {_mod_name(p) for p in builtin_file.read_text().split()}
    by_name = {_mod_name(p): p for p in deps}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in reversed(deps[path]):  # modules.dep lists the nearest dependency first
            visit(dep)
        order.append(path)

    for name in names:
        key = name.replace("-", "_")
        if key in builtin:
            continue
        if key not in by_name:
            raise GuestError(f"kernel {modules_dir.name}: module {name} is neither built in nor in {modules_dir}")
        visit(by_name[key])
    return order


def _mod_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    return base.split(".ko", 1)[0].replace("-", "_")


def _module_bytes(path: Path) -> bytes:
    """An uncompressed module (busybox insmod takes plain ELF); xz and zstd are decompressed here."""
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        import lzma

        return lzma.decompress(data)
    if path.name.endswith(".zst"):
        return subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True).stdout
    if path.name.endswith(".gz"):
        import gzip

        return gzip.decompress(data)
    return data


# ------------------------------------------------------------------------------------------ initramfs


def cpio_newc(entries: list[tuple[str, int, bytes, int, int]]) -> bytes:
    """An uncompressed newc cpio archive of (name, mode, data, rdev_major, rdev_minor) entries."""
    out = bytearray()

    def pad4() -> None:
        out.extend(b"\0" * (-len(out) % 4))

    for ino, (name, mode, data, major, minor) in enumerate([*entries, ("TRAILER!!!", 0, b"", 0, 0)], start=1):
        nameb = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, major, minor, len(nameb), 0)
        out.extend(b"070701" + b"".join(f"{v:08x}".encode() for v in fields))
        out.extend(nameb)
        pad4()
        out.extend(data)
        pad4()
    return bytes(out)


@dataclass(frozen=True)
class Share:
    """A host directory the guest sees writable at the same path (9p, no cache: writes reach the host)."""

    path: Path
    tag: str


@dataclass
class GuestSpec:
    kernel: Kernel
    mem: str = "2G"
    cpus: int = 2
    accel: str = "tcg"
    image: Path | None = None  # what qemu boots (boot_image); default: the kernel image
    shares: list[Share] = field(default_factory=list)
    cached_ro: list[Path] = field(default_factory=list)  # under a share, but read through the cached root (a venv)


def init_script(spec: GuestSpec, boot_modules: list[str], busybox: str = "/bin/busybox") -> str:
    """The guest's /init (busybox sh). Messages go to the serial console log; CMD's output to hvc0."""
    q = shlex.quote
    mounts = "\n".join(
        f"mkdir -p {q(f'/newroot{s.path}')} && mount -t 9p -o {NINEP_OPTS} {s.tag} {q(f'/newroot{s.path}')} || fail {q(f'cannot mount {s.path}')}"
        for s in spec.shares
    )
    binds = "\n".join(f"[ -d {q(f'/host{p}')} ] && mount --bind {q(f'/host{p}')} {q(f'/newroot{p}')}" for p in spec.cached_ro)
    insmods = "\n".join(f"insmod /modules/{Path(m).name.split('.ko')[0]}.ko || fail 'insmod {Path(m).name}'" for m in boot_modules)
    return f"""#!/bin/busybox sh
/bin/busybox mkdir -p /bin /proc /sys /dev /host /newroot /upper
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
stage() {{ read up rest < /proc/uptime; echo "guest-init: $up s: $*"; }}
fail() {{
    echo "guest-init: $*"
    [ -d /newroot/run/guest-job ] && echo "$*" > /newroot/run/guest-job/error
    sync; poweroff -f; sleep 10
}}
stage "loading the boot modules"
{insmods}
stage "mounting the host root"
mount -t 9p -o {NINEP_OPTS},ro,cache=loose hostroot /host || fail 'cannot mount the host root over 9p'
mount -t tmpfs -o mode=0755 upper /upper && mkdir -p /upper/u /upper/w
mount -t overlay overlay -o lowerdir=/host,upperdir=/upper/u,workdir=/upper/w /newroot || fail 'cannot mount the overlay'
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
mount -t tmpfs -o mode=0755 run /newroot/run
mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup 2>/dev/null
mkdir -p /newroot/run/guest-job
mount -t 9p -o {NINEP_OPTS} job /newroot/run/guest-job || fail 'cannot mount the job directory'
{mounts}
{binds}
cat > /newroot/run/guest-init2 <<'STAGE2'
{stage2_script(busybox)}STAGE2
stage "switching root"
exec switch_root /newroot {busybox} sh /run/guest-init2
fail 'switch_root failed'
"""


def stage2_script(busybox: str) -> str:
    """PID 1 after switch_root, in the overlay root. A real root, not a chroot: Mininet's `mnexec -a`
    enters a host's mount namespace, which resets root and cwd to the namespace's root; in a chroot that
    was the initramfs (seen as "No such file or directory" for every command run in a host)."""
    return f"""export PATH=/usr/sbin:/usr/bin:/sbin:/bin
stage() {{ read up rest < /proc/uptime; echo "guest-init: $up s: $*"; }}
stage "loading the testbed's modules"
/sbin/modprobe -a -q {" ".join(TESTBED_MODULES)}
missing=""
for m in {" ".join(TESTBED_MODULES)}; do [ -d /sys/module/$m ] || missing="$missing $m"; done
[ -n "$missing" ] && echo "modules not loaded:$missing" > /run/guest-job/modules-missing
{busybox} hostname prfaas-guest
ip link set lo up
stage "running the command"
: > /run/guest-job/started
/bin/sh /run/guest-job/job.sh </dev/null >/dev/hvc0 2>&1
echo $? > /run/guest-job/status
stage "command finished"
sync
{busybox} poweroff -f
sleep 10
"""


def build_initramfs(spec: GuestSpec, dest: Path) -> None:
    busybox = next((Path(p) for p in BUSYBOX_PATHS if Path(p).is_file()), None)
    if busybox is None:
        raise GuestError("no busybox: install busybox-static (bash scripts/bootstrap.sh setup)")
    if b"ld-linux" in busybox.read_bytes()[:8192]:
        raise GuestError(f"{busybox} is dynamically linked; the guest needs busybox-static")
    boot = module_order(spec.kernel.modules_dir, BOOT_MODULES)
    entries: list[tuple[str, int, bytes, int, int]] = [
        (d, 0o40755, b"", 0, 0) for d in ("bin", "dev", "proc", "sys", "host", "newroot", "upper", "modules")
    ]
    entries.append(("dev/console", 0o20600, b"", 5, 1))
    entries.append(("bin/busybox", 0o100755, busybox.read_bytes(), 0, 0))
    for rel in boot:
        name = Path(rel).name.split(".ko")[0] + ".ko"
        entries.append((f"modules/{name}", 0o100644, _module_bytes(spec.kernel.modules_dir / rel), 0, 0))
    entries.append(("init", 0o100755, init_script(spec, boot, str(busybox)).encode(), 0, 0))
    dest.write_bytes(cpio_newc(entries))


# ---------------------------------------------------------------------------------------------- qemu


def qemu_argv(spec: GuestSpec, initramfs: Path, job_dir: Path, console_log: Path) -> list[str]:
    accel = ["-accel", "kvm", "-cpu", "host"] if spec.accel == "kvm" else ["-accel", "tcg,thread=multi", "-cpu", "max"]
    image = spec.image or spec.kernel.image
    firmware = ["-bios", str(QBOOT)] if image != spec.kernel.image and QBOOT.is_file() else []  # qboot: PVH ELF only
    argv = [
        QEMU, "-name", "prfaas-guest", "-machine", "pc", *accel, *firmware, "-smp", str(spec.cpus), "-m", spec.mem,
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-nic", "none",
        "-serial", f"file:{console_log}",
        "-kernel", str(image), "-initrd", str(initramfs),
        "-append", "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-virtfs", f"local,path={job_dir},mount_tag=job,security_model=none",
        "-device", "virtio-serial-pci", "-chardev", "stdio,id=cmdout,signal=off", "-device", "virtconsole,chardev=cmdout",
    ]
    for s in spec.shares:
        argv += ["-virtfs", f"local,path={s.path},mount_tag={s.tag},security_model=none,multidevs=remap"]
    return argv


def job_script(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    lines = ["#!/bin/sh"]
    for k, v in sorted(env.items()):
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) and not _ENV_DROP.match(k):
            lines.append(f"export {k}={shlex.quote(v)}")
    lines.append(f"cd {shlex.quote(str(cwd))} 2>/dev/null || cd /")
    lines.append("exec " + " ".join(shlex.quote(a) for a in argv))
    return "\n".join(lines) + "\n"


@dataclass
class GuestResult:
    status: int  # CMD's exit status, or EXIT_TIMEOUT / EXIT_GUEST_FAILED
    accel: str
    boot_s: float | None  # qemu start -> CMD started (None: it never started)
    total_s: float
    error: str = ""  # why the guest could not run CMD
    console_tail: str = ""
    modules_missing: str = ""


def _die_with_parent() -> None:
    """In qemu's child before exec: SIGKILL when the harness dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def run_guest(spec: GuestSpec, argv: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float | None = None,
              stdout: int | None = None) -> GuestResult:
    """Boot the guest, run argv as root in it, stream its output to `stdout` (default: ours), power off.

    qemu is killed on every way out (timeout, exception, SIGTERM turned into an exception by the caller).
    """
    if shutil.which(QEMU) is None:
        raise GuestError(f"no {QEMU}: install qemu-system-x86 (bash scripts/bootstrap.sh setup)")
    with tempfile.TemporaryDirectory(prefix="prfaas-guest-") as tmp:
        work = Path(tmp)
        job = work / "job"
        job.mkdir()
        (job / "job.sh").write_text(job_script(argv, cwd, env))
        initramfs, console = work / "initramfs.cpio", work / "console.log"
        build_initramfs(spec, initramfs)
        t0 = time.monotonic()
        boot_s = None
        qemu_log = open(work / "qemu.log", "wb")
        proc = subprocess.Popen(qemu_argv(spec, initramfs, job, console), stdin=subprocess.DEVNULL, stdout=stdout, stderr=qemu_log,
                                preexec_fn=_die_with_parent)
        status: int | None = None
        try:
            while proc.poll() is None:
                if boot_s is None and (job / "started").exists():
                    boot_s = time.monotonic() - t0
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    status = EXIT_TIMEOUT
                    break
                time.sleep(0.05)
        finally:
            _stop(proc)
            qemu_log.close()
        total_s = time.monotonic() - t0
        if boot_s is None and (job / "started").exists():
            boot_s = total_s
        text = lambda p: p.read_text(errors="replace").strip() if p.exists() else ""  # noqa: E731
        error = text(job / "error")
        if status is None:
            raw = text(job / "status")
            if raw.isdigit():
                status = int(raw)
            else:
                status = EXIT_GUEST_FAILED
                qemu_err = [ln for ln in text(work / "qemu.log").splitlines() if "error" in ln.lower() or "failed" in ln.lower()]
                error = error or f"the guest stopped before CMD finished (qemu exit {proc.returncode}{': ' + qemu_err[0] if qemu_err else ''})"
        elif status == EXIT_TIMEOUT:
            error = f"timed out after {timeout_s:g} s"
        tail = "\n".join(text(console).splitlines()[-25:])
        return GuestResult(status, spec.accel, boot_s, total_s, error, tail, text(job / "modules-missing"))


# ---------------------------------------------------------------------------------------- accelerator


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def read_accel_cache(path: Path | None = None) -> dict[str, str] | None:
    """The cached probe's answer (`ACCEL_CACHE`), checked: ``boot_id``, ``kernel``, ``qemu`` and ``why`` strings,
    ``accel`` kvm or tcg; None when there is none. A damaged one (empty, cut short, not JSON, a wrong type, an
    accelerator qemu has no name for) is one line on stderr naming the file and what is wrong, and is probed again
    (then written anew): it was a KeyError or AttributeError traceback, or a bogus ``-accel`` for qemu."""
    from testbed.errors import UserError
    from testbed.validation import Fields, read_json, string, text

    path = ACCEL_CACHE if path is None else path
    if not os.path.lexists(path):
        return None
    try:
        data = read_json(path, "the cached KVM probe's answer (guest-accel.json)")
        if not isinstance(data, dict):
            raise UserError(f"{path}: must be a JSON object, got {type(data).__name__}")
        f = Fields(data, "", str(path))
        out = {k: f.get(k, string) for k in ("boot_id", "kernel", "qemu")}
        return {**out, "accel": f.choice("accel", ("kvm", "tcg")), "why": f.get("why", text)}
    except UserError as exc:
        print(f"guest-kernel: warning: {exc}; probing again", file=sys.stderr)
        return None


def choose_accel(spec: GuestSpec, requested: str) -> tuple[str, str]:
    """(accel, why). `auto`: KVM if a probe boot of this guest answers within KVM_PROBE_TIMEOUT_S."""
    if requested == "tcg":
        return "tcg", "asked for"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        if requested == "kvm":
            raise GuestError("--accel kvm: /dev/kvm is missing or not accessible")
        return "tcg", "no usable /dev/kvm"
    if requested == "kvm":
        return "kvm", "asked for"
    key = {"boot_id": _boot_id(), "kernel": str(spec.kernel.image), "qemu": shutil.which(QEMU) or ""}
    cached = read_accel_cache()
    if cached is not None and all(cached[k] == v for k, v in key.items()):
        return cached["accel"], cached["why"] + " (cached for this host boot)"
    probe = GuestSpec(spec.kernel, mem="256M", cpus=1, accel="kvm", image=spec.image)
    r = run_guest(probe, ["true"], cwd=Path("/"), env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                  timeout_s=KVM_PROBE_TIMEOUT_S, stdout=subprocess.DEVNULL)
    if r.status == 0:
        accel, why = "kvm", f"a KVM probe boot finished in {r.total_s:.1f} s"
    else:
        accel, why = "tcg", f"a KVM probe boot did not finish ({r.error or 'exit ' + str(r.status)})"
    from testbed.atomic import write_json
    from testbed.errors import UserError

    try:  # atomic: a reader never sees half of it
        write_json(ACCEL_CACHE, {**key, "accel": accel, "why": why})
    except UserError:  # not cached (a read-only /run): probed again next time
        pass
    return accel, why


# ------------------------------------------------------------------------------------------------ CLI


def guest_available() -> tuple[bool, str]:
    """(a guest can start here, why): root, qemu, busybox-static and a kernel with sch_netem; nothing is booted."""
    if os.geteuid() != 0:
        return False, "the guest harness needs root"
    if shutil.which(QEMU) is None:
        return False, f"{QEMU} is not installed (apt-get install qemu-system-x86)"
    if not any(Path(p).is_file() for p in BUSYBOX_PATHS):
        return False, "busybox-static is not installed"
    try:
        k = find_kernel()
    except GuestError as exc:
        return False, str(exc)
    return True, f"guest kernel {k.version} ({k.image})"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="guest-kernel.sh", description="Run CMD as root in a qemu guest whose kernel has netem.")
    p.add_argument("--kernel", help="guest kernel image (default: newest /boot/vmlinuz-* with sch_netem in its modules)")
    p.add_argument("--mem", default="2G", help="guest memory, e.g. 2G or 1536M (default 2G)")
    p.add_argument("--cpus", default="2", help="guest CPUs (default 2)")
    p.add_argument("--accel", default="auto", help="auto (KVM if a probe boot works, else TCG), kvm or tcg")
    p.add_argument("--out", action="append", default=[], help="a host directory the guest may write (repeatable; created)")
    p.add_argument("--timeout", default="0", help="seconds before the guest is killed (exit 124); 0: none")
    p.add_argument("--verbose", action="store_true", help="print the guest's console log at the end")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.cmd and a.cmd[0] == "--":
        a.cmd = a.cmd[1:]
    return a


def _usage_error(msg: str) -> int:
    print(f"guest-kernel: {msg}", file=sys.stderr)
    return 2


def shares_for(repo: Path, outs: list[Path]) -> tuple[list[Share], list[Path]]:
    """The project directory and every --out directory, writable; the project's .venv read through the cached root."""
    wanted = [repo, *outs]
    paths = sorted({p for p in wanted if not any(q in p.parents for q in wanted)})
    shares = [Share(p, f"share{i}") for i, p in enumerate(paths)]
    venv = Path(os.environ.get("PRFAAS_VENV", repo / ".venv"))
    cached = [venv] if venv.is_dir() and any(s.path in venv.parents for s in shares) else []
    return shares, cached


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)
    if not a.cmd:
        return _usage_error("no command: guest-kernel.sh [options] -- CMD...")
    if not re.fullmatch(r"\d+[MG]?", a.mem):
        return _usage_error(f"--mem: {a.mem!r} is not allowed; use a size such as 2G or 1536M")
    if not a.cpus.isdigit() or not 1 <= int(a.cpus) <= 64:
        return _usage_error(f"--cpus: {a.cpus!r} is not allowed; use a whole number 1-64")
    if a.accel not in ("auto", "kvm", "tcg"):
        return _usage_error(f"--accel: {a.accel!r} is not allowed; use auto, kvm or tcg")
    try:
        timeout_s = float(a.timeout)
        assert timeout_s >= 0
    except (ValueError, AssertionError):
        return _usage_error(f"--timeout: {a.timeout!r} is not allowed; use seconds >= 0")
    if os.geteuid() != 0:
        return _usage_error("run as root: the harness shares the host's root filesystem with the guest")
    outs = [Path(o).resolve() for o in a.out]
    for o in outs:
        o.mkdir(parents=True, exist_ok=True)
    try:
        kernel = find_kernel(a.kernel)
        shares, cached = shares_for(REPO, outs)
        spec = GuestSpec(kernel, mem=a.mem, cpus=int(a.cpus), shares=shares, cached_ro=cached, image=boot_image(kernel))
        spec.accel, why = choose_accel(spec, a.accel)
    except GuestError as exc:
        print(f"guest-kernel: {exc}", file=sys.stderr)
        return EXIT_GUEST_FAILED
    print(f"guest-kernel: Linux {kernel.version} ({kernel.image}), {spec.accel.upper()} ({why}), "
          f"{spec.cpus} CPUs, {spec.mem}; writable: {', '.join(str(s.path) for s in shares)}", file=sys.stderr, flush=True)
    env = dict(os.environ, PRFAAS_GUEST="1", PRFAAS_GUEST_ACCEL=spec.accel)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        r = run_guest(spec, a.cmd, cwd=Path.cwd(), env=env, timeout_s=timeout_s or None)
    except KeyboardInterrupt:
        print("guest-kernel: interrupted; the guest was stopped", file=sys.stderr)
        return 130
    except GuestError as exc:
        print(f"guest-kernel: {exc}", file=sys.stderr)
        return EXIT_GUEST_FAILED
    sys.stdout.flush()
    if r.modules_missing:
        print(f"guest-kernel: warning: {r.modules_missing}", file=sys.stderr)
    boot = f"{r.boot_s:.1f} s" if r.boot_s is not None else "-"
    print(f"guest-kernel: exit status {r.status}; boot to CMD {boot}, total {r.total_s:.1f} s ({r.accel.upper()})", file=sys.stderr)
    if r.error:
        print(f"guest-kernel: {r.error}", file=sys.stderr)
    if a.verbose or r.status == EXIT_GUEST_FAILED:
        print("guest-kernel: console log (last lines):\n" + r.console_tail, file=sys.stderr)
    return r.status


if __name__ == "__main__":
    sys.exit(main())
