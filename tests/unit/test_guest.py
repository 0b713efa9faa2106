"""The guest-kernel harness's pure parts: initramfs archive, module order, kernel image, job script, options."""

import lzma
import subprocess
from pathlib import Path

import pytest

from testbed.net import guest


def read_newc(data: bytes) -> dict[str, tuple[int, bytes, int, int]]:
    """name -> (mode, data, rdev major, rdev minor), parsed independently of the writer."""
    out, at = {}, 0
    while True:
        assert data[at:at + 6] == b"070701"
        f = [int(data[at + 6 + 8 * i: at + 14 + 8 * i], 16) for i in range(13)]
        mode, size, major, minor, namesize = f[1], f[6], f[9], f[10], f[11]
        name_at = at + 110
        name = data[name_at:name_at + namesize - 1].decode()
        data_at = (name_at + namesize + 3) & ~3
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, data[data_at:data_at + size], major, minor)
        at = (data_at + size + 3) & ~3


def test_cpio_holds_files_dirs_and_the_console_device():
    arc = guest.cpio_newc([("bin", 0o40755, b"", 0, 0), ("dev/console", 0o20600, b"", 5, 1),
                           ("init", 0o100755, b"#!/bin/sh\necho 1\n", 0, 0), ("odd", 0o100644, b"abcde", 0, 0)])
    got = read_newc(arc)
    assert got["init"] == (0o100755, b"#!/bin/sh\necho 1\n", 0, 0)
    assert got["odd"][1] == b"abcde"
    assert got["dev/console"][0] == 0o20600 and got["dev/console"][2:] == (5, 1)
    assert len(arc) % 4 == 0


def fake_modules(tmp_path: Path) -> Path:
    d = tmp_path / "6.1.0-test"
    d.mkdir()
    (d / "modules.dep").write_text(
        "kernel/fs/9p/9p.ko: kernel/fs/fscache/fscache.ko kernel/net/9p/9pnet.ko kernel/fs/netfs/netfs.ko\n"
        "kernel/net/9p/9pnet.ko:\n"
        "kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko\n"
        "kernel/fs/netfs/netfs.ko:\n"
        "kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio_ring.ko\n"
        "kernel/drivers/virtio/virtio_ring.ko:\n"
        "kernel/net/sched/sch_netem.ko.xz:\n")
    (d / "modules.builtin").write_text("kernel/fs/overlayfs/overlay.ko\n")
    return d


def test_modules_load_after_their_dependencies_once_each_builtins_skipped(tmp_path):
    d = fake_modules(tmp_path)
    order = guest.module_order(d, ("9pnet_virtio", "9p", "overlay", "sch-netem"))
    names = [p.rsplit("/", 1)[-1] for p in order]
    assert sorted(names) == sorted(["9pnet.ko", "virtio_ring.ko", "9pnet_virtio.ko", "netfs.ko", "fscache.ko", "9p.ko", "sch_netem.ko.xz"])
    deps = {ln.split(":")[0]: ln.split(":")[1].split() for ln in (d / "modules.dep").read_text().splitlines()}
    for i, path in enumerate(order):
        assert all(order.index(dep) < i for dep in deps[path]), (path, order)


def test_unknown_module_is_named(tmp_path):
    with pytest.raises(guest.GuestError, match="module sch_cake"):
        guest.module_order(fake_modules(tmp_path), ("sch_cake",))


def test_bzimage_version_is_read_from_the_boot_header(tmp_path):
    img = bytearray(0x400)
    img[0x202:0x206] = b"HdrS"
    img[0x20E:0x210] = (0x100).to_bytes(2, "little")  # version string at 0x100 + 0x200
    img[0x300:0x300 + 40] = b"6.1.0-57-amd64 (debian-kernel@lists)\0\0\0\0"
    (tmp_path / "vmlinuz").write_bytes(bytes(img))
    assert guest.bzimage_version(tmp_path / "vmlinuz") == "6.1.0-57-amd64"
    (tmp_path / "bad").write_bytes(b"\0" * 0x400)
    with pytest.raises(guest.GuestError, match="not a bzImage"):
        guest.bzimage_version(tmp_path / "bad")


def test_vmlinux_with_a_pvh_entry_is_extracted_else_the_bzimage_is_booted(tmp_path):
    pvh_note = b"\x04\x00\x00\x00\x04\x00\x00\x00\x12\x00\x00\x00Xen\x00\x00\x00\x00\x01"
    elf = b"\x7fELF" + b"\0" * 100 + pvh_note + b"\0" * 100
    (tmp_path / "with").write_bytes(b"setup code" * 10 + lzma.compress(elf, format=lzma.FORMAT_XZ))
    (tmp_path / "without").write_bytes(b"setup code" * 10 + lzma.compress(b"\x7fELF" + b"\0" * 200, format=lzma.FORMAT_XZ))
    assert guest.extract_vmlinux(tmp_path / "with") == elf
    assert guest.extract_vmlinux(tmp_path / "without") is None


def test_job_script_runs_argv_verbatim_in_cwd_with_the_callers_env(tmp_path):
    argv = ["sh", "-c", 'printf "%s|" "$0" "$1" "$GREETING" "$(pwd)" "${PYTEST_CURRENT_TEST:-unset}"; exit 7', "it's", "a b"]
    env = {"PATH": "/usr/bin:/bin", "GREETING": "hello 'world'", "PYTEST_CURRENT_TEST": "x", "BAD-NAME": "y"}
    script = tmp_path / "job.sh"
    script.write_text(guest.job_script(argv, tmp_path, env))
    r = subprocess.run(["sh", str(script)], capture_output=True, text=True, env={})
    assert r.returncode == 7
    assert r.stdout == f"it's|a b|hello 'world'|{tmp_path}|unset|"


def test_init_mounts_shares_and_loads_netem():
    k = guest.Kernel(Path("/boot/vmlinuz-x"), "x")
    spec = guest.GuestSpec(k, shares=[guest.Share(Path("/work/p q"), "share0")], cached_ro=[Path("/work/p q/.venv")])
    init = guest.init_script(spec, ["kernel/a/virtio.ko", "kernel/b/9p.ko"])
    assert init.index("insmod /modules/virtio.ko") < init.index("insmod /modules/9p.ko") < init.index("hostroot /host")
    assert "share0 '/newroot/work/p q'" in init and "mount --bind '/host/work/p q/.venv'" in init
    assert "sch_netem" in init and "xt_NFQUEUE" in init and "> /run/guest-job/status" in init
    assert init.index("guest-init2") < init.index("exec switch_root /newroot /bin/busybox sh /run/guest-init2")


def test_project_and_out_dirs_are_shared_once(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".venv").mkdir(parents=True)
    shares, cached = guest.shares_for(repo, [repo / "runs" / "a", tmp_path / "out"])
    assert [s.path for s in shares] == [tmp_path / "out", repo]
    assert len({s.tag for s in shares}) == 2


def test_qemu_argv_tcg_uses_cpu_max_and_streams_on_stdio(tmp_path):
    k = guest.Kernel(Path("/boot/vmlinuz-x"), "x")
    argv = guest.qemu_argv(guest.GuestSpec(k, mem="1536M", cpus=2), tmp_path / "i", tmp_path / "job", tmp_path / "c")
    assert argv[argv.index("-cpu") + 1] == "max" and argv[argv.index("-m") + 1] == "1536M"
    assert "stdio,id=cmdout,signal=off" in argv and "-no-reboot" in argv
    assert any("readonly=on" in a and "path=/," in a for a in argv)


@pytest.mark.parametrize("args, field", [
    (["--mem", "lots", "--", "true"], "--mem"), (["--cpus", "0", "--", "true"], "--cpus"),
    (["--accel", "hvf", "--", "true"], "--accel"), (["--timeout", "-1", "--", "true"], "--timeout"), ([], "no command"),
])
def test_bad_options_are_one_line_and_exit_2(capsys, args, field):
    assert guest.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]
