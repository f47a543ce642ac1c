"""What the three scripts share by design (each has its own copy): run folders that never mix
(made atomically, locked while a run writes), writes that a signal does not cut, and one line
for a JAX platform the machine lacks."""

import contextlib
import dataclasses
import fcntl
import importlib.util
import io
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import pytest

import dqn_cartpole
import parallel_q_learning
import q_learning_gridworld

SCRIPTS = [q_learning_gridworld, dqn_cartpole, parallel_q_learning]
# A short run of each, as its own tests make one (their programs are in the compilation cache).
SHORT_RUNS = {
    q_learning_gridworld: "--num-seeds 3 --layout maze",
    dqn_cartpole: "--total-timesteps 1000 --eval-every 500 --num-seeds 3 --hidden-sizes 16,16 "
    "--buffer-size 256 --batch-size 16 --train-frequency 2 --target-update-interval 100 "
    "--learning-starts 200 --eval-episodes 2",
    parallel_q_learning: "--num-seeds 3 --total-timesteps 2000 --learning-rates 0.1,0.5",
}
pytestmark = pytest.mark.parametrize("script", SCRIPTS, ids=lambda module: module.__name__)


def test_runs_started_in_the_same_second_get_their_own_folders(script, tmp_path, monkeypatch):
    monkeypatch.setattr(script.time, "strftime", lambda _: "now")  # the same second, surely
    folders = [script.make_folder(str(tmp_path / "run_{time}")) for _ in range(3)]
    assert [folder.name for folder in folders] == ["run_now", "run_now_2", "run_now_3"]
    for template in ("run_{time}/..", "run_{time}/../x"):  # names that would never be new
        with pytest.raises(ValueError, match="'..' and {time} together"):
            script.run_folder(str(tmp_path / template), overwrite=False)
    with pytest.raises(ValueError, match="^--overwrite: nothing to replace in"):  # was ignored
        script.run_folder(str(tmp_path / "run_{time}"), overwrite=True)


def test_a_folder_name_the_os_refuses_leaves_no_parent_folder_behind(script, tmp_path):
    for template in ("a/b/" + "x" * 300, "a/b/{time}_" + "x" * 300):  # too long a name
        with pytest.raises(OSError):
            script.make_folder(str(tmp_path / template))
        assert list(tmp_path.iterdir()) == []


def test_a_stopped_run_leaves_no_empty_folder_nor_the_parents_made_for_it(script, tmp_path):
    (tmp_path / "kept").mkdir()  # there before the run: stays, even empty
    script.remove_if_empty(script.make_folder(str(tmp_path / "kept/a/b/run")))
    assert list(tmp_path.iterdir()) == [tmp_path / "kept"] and not any(
        (tmp_path / "kept").iterdir()
    )
    written = script.make_folder(str(tmp_path / "c/run")) / "summary.json"
    written.touch()
    script.remove_if_empty(written.parent)  # something was written: nothing removed
    assert written.exists()
    (tmp_path / "mine").mkdir()  # named outright, there before the run: stays, even empty
    script.remove_if_empty(script.make_folder(str(tmp_path / "mine")))
    assert (tmp_path / "mine").is_dir()


def test_a_folder_that_another_running_run_writes_to_is_refused(script, tmp_path):
    held = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as another run's make_folder holds it
    try:
        with pytest.raises(OSError, match="in use by another run"):
            script.make_folder(str(tmp_path))
    finally:
        os.close(held)  # that run ended
    assert script.make_folder(str(tmp_path)) == tmp_path


def test_a_run_that_ends_between_the_check_and_the_lock_is_not_replaced(script, tmp_path):
    for folder in (tmp_path / "there", tmp_path / "not_yet"):  # an empty folder, and none
        if folder.name == "there":
            folder.mkdir()
        script.run_folder(str(folder), overwrite=False)  # empty: this run may use it
        folder.mkdir(exist_ok=True)
        (folder / "summary.json").write_text("another run's")  # that run ends, unlocking it
        with pytest.raises(OSError, match="now holds another run's files"):
            script.make_folder(str(folder))
        assert (folder / "summary.json").read_text() == "another run's"
        free = os.open(folder, os.O_RDONLY)
        fcntl.flock(free, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the refused run let its lock go
        os.close(free)
    full = tmp_path / "full"
    script.run_folder(str(full), overwrite=False)  # a check whose run went no further
    full.mkdir()
    (full / "summary.json").touch()
    script.run_folder(str(full), overwrite=True)  # the next run, asked to replace that one
    assert script.make_folder(str(full)) == full
    script.run_folder(str(tmp_path / "asked"), overwrite=True)  # empty, and --overwrite given
    (tmp_path / "asked").mkdir()
    (tmp_path / "asked" / "summary.json").touch()  # a run ends there: this one may replace it
    assert script.make_folder(str(tmp_path / "asked")) == tmp_path / "asked"


def test_overwrite_refuses_a_folder_or_a_users_tmp_file_among_a_runs_files(script, tmp_path):
    for name, make in (("summary.json", Path.mkdir), ("notes.tmp", Path.touch)):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        make(folder / name)
        with pytest.raises(ValueError, match=f"holds {name}, which no run of this script writes"):
            script.run_folder(str(folder), overwrite=True)


def test_overwrite_removes_a_runs_files_and_nothing_else(script, tmp_path):
    for name in script.RUN_NAMES:  # a run's files, and temporaries of a write that was cut
        (tmp_path / name).touch()
        script.temporary(tmp_path / name).touch()
    (tmp_path / "notes.md").touch()  # put there while the new run trained
    with script.replacing(tmp_path):  # the previous run set aside while the new one is written
        pass
    assert [path.name for path in tmp_path.iterdir()] == ["notes.md"]


def test_overwrite_keeps_the_previous_run_if_the_new_one_cannot_be_written(script, tmp_path):
    """A full disk as --overwrite writes the new run: the previous run's files stay as they
    were, and none of the new one's (they were removed before the writing once)."""
    for name in script.RUN_NAMES:
        (tmp_path / name).write_text(f"previous {name}")
    (tmp_path / "notes.md").touch()
    first, second = script.RUN_NAMES[:2]
    with pytest.raises(SystemExit), script.replacing(tmp_path):
        with script.atomic_open(tmp_path / first) as file:
            file.write("new")
        with script.atomic_open(tmp_path / second) as file:
            raise OSError(28, "No space left on device")
    assert {path.name: path.read_text() for path in tmp_path.iterdir()} == {
        "notes.md": "",
        **{name: f"previous {name}" for name in script.RUN_NAMES},
    }
    with script.replacing(tmp_path), script.atomic_open(tmp_path / first) as file:
        file.write("new")
    assert {path.name: path.read_text() for path in tmp_path.iterdir()} == {
        "notes.md": "",
        first: "new",
    }


def test_overwrite_that_fails_to_set_the_previous_run_aside_puts_it_back(
    script, tmp_path, monkeypatch, capsys
):
    """A rename that fails part way through setting the previous run aside (a full disk that
    has no room for a folder entry, say) left the files moved so far under their set-aside
    names, which the next write removed as a crash's leftovers: the previous run lost a file.
    Now the files moved come back, and the rest were never touched; one line says so, exit 1
    (it was a traceback, as for a file that cannot be moved: immutable, another user's)."""
    previous = {name: f"previous {name}" for name in script.RUN_NAMES}
    for name, text in previous.items():
        (tmp_path / name).write_text(text)
    calls = []

    def full_disk(source, target):
        calls.append(Path(target).name)
        if len(calls) == 3:  # the third rename aside
            raise OSError(28, "No space left on device")
        return os.rename(source, target)

    with monkeypatch.context() as patch, pytest.raises(SystemExit) as exit_info:
        patch.setattr(script.os, "replace", full_disk)
        with script.replacing(tmp_path):
            pytest.fail("the new run was written")
    assert calls[3:] == list(script.RUN_NAMES[:2])  # the two set aside came back
    assert {path.name: path.read_text() for path in tmp_path.iterdir()} == previous
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 1 and err == [
        f"{script.__name__}.py: error: --overwrite: cannot set {tmp_path / script.RUN_NAMES[2]} "
        "aside (No space left on device); the run there stays as it was, and this one is not "
        "written"
    ], err


def test_a_write_that_fails_is_one_line_and_leaves_no_temporary_file(script, tmp_path, capsys):
    """A full disk (here a file size limit: the write fails with EFBIG, as with ENOSPC; Python
    ignores SIGXFSZ) or a folder in the way of the rename: the script ends with one line naming
    the file, exit 1, and no temporary file is left."""
    (tmp_path / "in_the_way").mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for name, limit in (("big", 1_000), ("in_the_way", soft)):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            with pytest.raises(SystemExit) as exit_info, script.atomic_open(tmp_path / name) as f:
                f.write("x" * 10_000)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 1 and len(err) == 1, err
        assert err[0].startswith(f"{script.__name__}.py: error: cannot write {tmp_path / name}")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in_the_way"]
    run = script.make_folder(str(tmp_path / "run"))  # its first file fails: no empty folder left
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000, hard))
    try:
        with pytest.raises(SystemExit), script.atomic_open(run / "summary.json") as file:
            file.write("x" * 10_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not run.exists()


def test_a_run_whose_last_file_cannot_be_written_leaves_none_of_its_files(
    script, tmp_path, monkeypatch, capsys
):
    """A full disk as a run writes its last file: the files before it stayed, a summary without
    its params or Q-tables, which --load, --replot and --resume each refused as another kind of
    folder (found by an adversarial pass). Now a run's files appear all or none: one line, exit
    1, and the folders made for it go; also where a tabular run's figure fails."""
    last, opened = script.RUN_FILES[-1], script.atomic_open

    @contextlib.contextmanager
    def full_disk(path, *args, **kwargs):
        with opened(path, *args, **kwargs) as file:
            if path.name == last:
                raise OSError(28, "No space left on device")
            yield file

    monkeypatch.setattr(script, "atomic_open", full_disk)
    output = tmp_path / "made" / "run"
    with pytest.raises(SystemExit) as exit_info:
        script.main([*shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)])
    err = capsys.readouterr().err.strip().splitlines()  # the DQN's progress lines, then its own
    line = f"{script.__name__}.py: error: cannot write {output / last} (No space left on device)"
    assert exit_info.value.code == 1 and err[-1] == line, err
    assert list(tmp_path.iterdir()) == []
    if script is not dqn_cartpole:  # a tabular run and its figure are written whole, or neither:
        last = script.RUN_NAMES[-1]  # its files went, and left the folder made for it, empty
        with pytest.raises(SystemExit) as exit_info:
            script.main([*shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)])
        assert exit_info.value.code == 1 and list(tmp_path.iterdir()) == []


def test_sigterm_and_sighup_at_once_stop_the_script_once(script, monkeypatch):
    """A hang-up and a SIGTERM that come together (a closed terminal, a process group): one
    Stopped, and nothing else (Python printed OSError 'Signal 15 ignored due to race condition'
    with a traceback, when the first handler had set the other to SIG_IGN)."""
    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)  # where Python prints that
    monkeypatch.setattr(script, "RECEIVED", [])  # what stop() notes, this test's own
    both = {signal.SIGTERM, signal.SIGHUP}
    saved = {signum: signal.getsignal(signum) for signum in both}
    try:
        for signum in both:
            signal.signal(signum, script.stop)
        signal.pthread_sigmask(signal.SIG_BLOCK, both)
        for signum in both:  # to this thread, which holds them: not to one of JAX's threads
            signal.pthread_kill(threading.get_ident(), signum)
        with pytest.raises(script.Stopped):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, both)  # runs the handlers
        signal.pthread_sigmask(signal.SIG_BLOCK, set())  # Python looks at pending signals again
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert not printed, printed[0].exc_value
    assert len(script.RECEIVED) == 1, script.RECEIVED


def test_a_signal_while_writing_waits_until_the_run_is_written(script, tmp_path):
    written = tmp_path / "file"
    with pytest.raises(SystemExit) as exit_info, script.written_whole():
        os.kill(os.getpid(), signal.SIGTERM)
        written.write_text("whole")  # still written, after the signal came
    assert exit_info.value.code == 128 + signal.SIGTERM and written.read_text() == "whole"


def test_replot_of_an_empty_folder_name_is_one_line(script, tmp_path, capsys, monkeypatch):
    """Path("") is ".": the gridworld and the sweep redrew the run in the current folder, or
    named "." as not a saved run."""
    monkeypatch.chdir(tmp_path)
    for name in script.RUN_FILES:  # a run here would have been redrawn
        (tmp_path / name).write_text("{bad")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--replot", ""])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].endswith("error: --replot must name a run's folder"), err


def test_replot_of_a_damaged_run_is_one_line(script, tmp_path, capsys):
    for name in script.RUN_FILES:  # every file a run needs, none of them readable
        (tmp_path / name).write_text("{bad")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--replot", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--replot" in err[0], err


def test_the_summary_records_the_xla_flags_jax_started_with(script, monkeypatch):
    """Read from the environment as the summary was written, a change made after JAX started
    (a notebook's) was recorded as if the run had had it."""
    started_with = os.environ["XLA_FLAGS"]  # conftest's, before the scripts were imported
    monkeypatch.setenv("XLA_FLAGS", "--xla_set_after_jax_started")
    settings = script.jax_settings()
    assert settings["XLA_FLAGS"] == started_with and settings["jax_enable_x64"] is False
    assert settings["jax_threefry_partitionable"] == jax.config.jax_threefry_partitionable


def test_replot_names_a_damaged_summary_and_a_setting_it_lacks(script, tmp_path, capsys):
    """A damaged summary.json was `cannot redraw (KeyError: 'config')`, naming no file; one whose
    config lacked a setting was drawn, in the gridworld, with the default in its place (which
    may not have been the run's). summary.json is read first: the other files are never read."""
    for name in script.RUN_FILES:
        (tmp_path / name).write_text("not read")
    config = json.loads(json.dumps(dataclasses.asdict(script.Config())))  # as a run saves it
    lacking = {name: value for name, value in config.items() if name != "total_timesteps"}
    for summary, why in (
        ("{bad", "summary.json: JSONDecodeError: "),
        (json.dumps({"grid": []}), "summary.json: KeyError: 'config'"),
        (json.dumps({"grid": [], "config": lacking}), "summary.json: its config lacks "),
    ):
        (tmp_path / "summary.json").write_text(summary)
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--replot", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1, err
        assert f"--replot {tmp_path}: cannot redraw ({why}" in err[0], err


# cuda where no NVIDIA GPU is seen: JAX passes over it, and would train on the CPU unasked.
NO_GPU = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be here")


@pytest.mark.parametrize(
    "variable, value",
    [
        ("JAX_PLATFORMS", "nosuchplatform"),
        pytest.param("JAX_PLATFORMS", "cuda", marks=NO_GPU),
        ("XLA_FLAGS", "--xla_force_host_platform_device_count=0"),  # no CPU device
    ],
)
def test_a_jax_platform_this_machine_lacks_is_one_line(script, tmp_path, variable, value):
    output = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, script.__file__, "--output-dir", str(output)],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", variable: value},
    )
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1, err
    assert f"{variable}={value!r}" in err[0] and "AssertionError" not in err[0], err  # JAX's
    assert not output.exists()


@pytest.mark.parametrize("moment", ["as JAX loads", "once the handlers are in place"])
def test_a_signal_handled_in_a_garbage_collector_callback_still_stops_the_run(
    script, tmp_path, moment
):
    """Python prints and drops an exception raised in a garbage-collector callback (JAX has one):
    a Ctrl-C or SIGTERM that arrived while one ran was lost, and the run went on to its end (exit
    0). Here the signal is sent from such a callback, while the script's imports load JAX (where
    a Ctrl-C was also a traceback, and a SIGTERM ended the script without a word), or once the
    script's handlers are in place."""
    # Ctrl-C in one script, SIGTERM in two (stop() handles both)
    signum = signal.SIGINT if script is q_learning_gridworld else signal.SIGTERM
    output = tmp_path / "run"
    argv = [script.__file__, *shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)]
    handlers = 'getattr(signal.getsignal(signal.SIGTERM), "__name__", "") == "stop"'
    now = '"jax" in sys.modules' if moment == "as JAX loads" else handlers
    result = run_signalled_from_a_gc_callback(argv, signum, now)
    assert_stopped_before_any_work(script, result, signum, output)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_a_signal_whose_exception_was_dropped_still_stops_the_run(script, tmp_path, signum):
    """C code that clears errors drops the exception a signal's handler raised while it ran: the
    run went on to its end, exit 0. The test above did so about once in 50 runs, where the signal
    sent again landed in JAX's first import of its MLIR dialects. Now the run stops before
    training. Here the garbage-collector callback that sends the signal drops it itself."""
    output = tmp_path / "run"
    argv = [script.__file__, *shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)]
    handlers = 'getattr(signal.getsignal(signal.SIGTERM), "__name__", "") == "stop"'
    result = run_signalled_from_a_gc_callback(argv, signum, handlers, drop=True)
    assert_stopped_before_any_work(script, result, signum, output)


def run_signalled_from_a_gc_callback(argv: list[str], signum: int, now: str, drop=False):
    """Runs argv (a script and its flags) as __main__ in a fresh Python, which sends itself
    signum from a garbage-collector callback, once, the first time the expression `now` holds
    (and drops the exception its handler raises, with drop). It prints "sent" when it has."""
    # Its handler runs here, in the callback.
    send = sending(f"os.kill(os.getpid(), {int(signum)})", drop)
    code = f"""import gc, os, runpy, signal, sys
def send(phase, info):
    if {now} and not sent:
        os.write(1, b"sent\\n")
        sent.append(True)
        {send}
sent = []
gc.callbacks.append(send)
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert "sent" in result.stdout.splitlines(), (result.returncode, result.stderr[-2000:])
    return result


def test_a_signal_once_the_run_has_ended_has_its_default_effect(script, tmp_path):
    """A SIGTERM in the clean-up at exit (JAX's, about half a second after the last line) ended
    in the script's handler there: Python printed and dropped its exception, and the resend
    killed the finished run's process with SIGALRM (exit 142, 'Alarm clock'). Now it has its
    default effect, exit 143. Here an exit handler of the test's own sends it."""
    output = tmp_path / "run"
    argv = [script.__file__, *shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)]
    code = f"""import atexit, os, runpy, signal, sys, time
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == -signal.SIGTERM, (result.returncode, result.stderr[-2000:])
    assert "Exception ignored" not in result.stderr, result.stderr[-2000:]
    assert all((output / name).is_file() for name in script.RUN_FILES), sorted(output.iterdir())


def test_a_signal_once_training_has_ended_waits_until_the_run_is_written(script, tmp_path):
    """A SIGTERM between the end of training and the writes (where the tabular scripts summarize
    the run, checked against value iteration) stopped the script, and the trained run was lost.
    Now it waits until the run is written whole, as one during the writes does. Here a profile
    function of the test's own sends it as the summary begins."""
    first_after_training = "summarize_grid" if script is parallel_q_learning else "summarize"
    output = tmp_path / "run"
    argv = [script.__file__, *shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)]
    result = run_signalled_as_called(argv, first_after_training)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 128 + signal.SIGTERM, (result.returncode, err)
    stopped = "stopped by SIGTERM once the run was written whole"  # asked for: not an "error:"
    assert err[-1] == f"{Path(script.__file__).name}: {stopped}", err
    assert all((output / name).is_file() for name in script.RUN_FILES), sorted(output.iterdir())


def test_a_signal_dropped_once_training_has_begun_stops_the_run_once_written(script, tmp_path):
    """A signal whose exception C code dropped (see above) after the check before training: the
    run goes on, but exits as stopped by the signal once it is written whole, not 0. Here it is
    sent and dropped as the run waits for its compiled call: the tabular scripts' training, or
    --load's evaluation (the DQN trains inside written_whole, whose handlers raise nothing)."""
    output = tmp_path / "run"
    argv = [script.__file__, *shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)]
    function, written = "wait", script.RUN_FILES
    if script is dqn_cartpole:
        subprocess.run([sys.executable, *argv], capture_output=True, check=True)  # main() would
        # keep its folder locked
        argv = [script.__file__, "--load", str(output)]
        written = ["load_summary.json"]
    result = run_signalled_as_called(argv, function, drop=True)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 128 + signal.SIGTERM, (result.returncode, err)
    stopped = "stopped by SIGTERM once the run was written whole"  # asked for: not an "error:"
    assert err[-1] == f"{Path(script.__file__).name}: {stopped}", err
    assert all((output / name).is_file() for name in written), sorted(output.iterdir())


def test_an_error_while_training_leaves_no_empty_folder(script, tmp_path):
    """A run that fails as it trains (JAX_DEBUG_NANS=1 did in the DQN until its metrics lost their
    NaN) ends with its traceback, and the folder made for it goes, as a
    stopped run's does: the DQN left it empty. Here a profile function of the test's own raises
    as training begins."""
    first = {q_learning_gridworld: "train_seeds", parallel_q_learning: "run_sweep"}
    output = tmp_path / "made" / "run"
    argv = [script.__file__, *shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)]
    code = f"""import runpy, sys
def fail(frame, event, arg):
    if event == "call" and frame.f_code.co_name == {first.get(script, "train_agents")!r}:
        raise RuntimeError("the test's own")
sys.setprofile(fail)
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 1 and err[-1] == "RuntimeError: the test's own", err[-3:]
    assert not (tmp_path / "made").exists()


def run_signalled_as_called(argv: list[str], function: str, drop=False):
    """Runs argv (a script and its flags) as __main__ in a fresh Python, which sends itself a
    SIGTERM as the script first calls `function` (and drops the exception its handler raises,
    with drop). It prints "sent" when it has."""
    send = sending("os.kill(os.getpid(), signal.SIGTERM)", drop)
    code = f"""import os, runpy, signal, sys
def send(frame, event, arg):
    if event == "call" and frame.f_code.co_name == {function!r} and \\
            frame.f_globals.get("__name__") == "__main__":
        sys.setprofile(None)
        os.write(1, b"sent\\n")
        {send}
sys.setprofile(send)
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "sent" in result.stdout.splitlines(), (result.returncode, result.stderr[-2000:])
    return result


def sending(statement: str, drop: bool) -> str:
    """`statement` (it sends a signal) as the test's code runs it, in an `if` in a function; with
    drop, in a `try` that drops what its handler raises, as C code that clears errors does."""
    if not drop:
        return statement
    return f"try:\n            {statement}\n        except BaseException:\n            pass"


def test_a_signal_while_a_cluster_watcher_loads_jax_reaches_its_child(script, tmp_path):
    """A process other than 0 of a cluster does its work in a child that it watches, ignoring
    Ctrl-C and SIGHUP itself (they reach the child as they reach it). One that came while the
    watcher loaded JAX, before the child was there, was dropped: the child went on, here waiting
    for a process 0 that never comes ("nobody answered", exit 2). Now it is passed on."""
    if script is q_learning_gridworld:
        pytest.skip("one process, no cluster: no watcher")
    cluster = ["--coordinator-address", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1"]
    argv = [script.__file__, *cluster, "--cluster-timeout", "20"]
    result = run_signalled_from_a_gc_callback(argv, signal.SIGINT, now='"jax" in sys.modules')
    assert_stopped_before_any_work(script, result, signal.SIGINT, tmp_path / "no folder")


def test_a_signal_while_jax_loads_its_plugins_still_stops_the_run(script, tmp_path):
    """JAX's first use of a device loads its plugins (jax[cuda]'s loads CUDA's libraries) and drops
    whatever a plugin's initialize() raises: a Ctrl-C or SIGTERM that arrived then was lost (the
    run went on to its end, exit 0; on a GPU, whose plugin it cut short, 'no JAX backend'). Here
    a plugin of the test's own sends the signal while it loads."""
    signum = signal.SIGINT if script is q_learning_gridworld else signal.SIGTERM
    plugin = tmp_path / "plugins" / "jax_plugins" / "signal_on_load"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(
        "import os\n\n\ndef initialize():\n"
        f"    os.kill(os.getpid(), {int(signum)})\n"
        "    sum(range(1000))  # its handler runs here, inside JAX's loop over plugins\n"
    )
    output = tmp_path / "run"
    argv = [script.__file__, *shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)]
    paths = [str(plugin.parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )
    assert_stopped_before_any_work(script, result, signum, output)


def assert_stopped_before_any_work(script, result, signum, output):
    err = result.stderr.strip().splitlines()
    assert result.returncode == 128 + signum and len(err) == 1, err
    assert f"stopped by {script.SIGNALS[signum]}" in err[0]
    assert "compile" not in result.stdout and not output.exists()


def test_jit_turned_off_is_one_line_before_any_work(script, tmp_path, capsys):
    """JAX_DISABLE_JIT=1 (or jax.disable_jit()) ran the sharded run eagerly: hours for a short
    run, or a traceback (a scan of 0 blocks in the tabular scripts). It is one line, which says
    how to step through train() instead."""
    output = tmp_path / "run"
    with jax.disable_jit(), pytest.raises(SystemExit) as exit_info:
        script.main([*shlex.split(SHORT_RUNS[script]), "--output-dir", str(output)])
    printed = capsys.readouterr()
    err = printed.err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert "JAX_DISABLE_JIT" in err[0] and "jax.disable_jit()" in err[0], err
    assert "compile" not in printed.out and not output.exists()
    argv = [sys.executable, script.__file__, "--output-dir", str(output)]  # the variable itself
    env = {**os.environ, "JAX_DISABLE_JIT": "1"}
    result = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert result.returncode == 2 and result.stderr.splitlines() == err, result.stderr
    assert not output.exists()


def test_an_output_folder_this_user_cannot_write_to_is_one_line(
    script, tmp_path, monkeypatch, capsys
):
    """Refused before any training (a read-only mount, say), not at the first write after it."""
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # nothing writable
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--output-dir", str(tmp_path), "--total-timesteps", "2000"])
    monkeypatch.undo()
    printed = capsys.readouterr()
    err = printed.err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--output-dir" in err[0], err
    assert "compile" not in printed.out and not any(tmp_path.iterdir())


def test_a_run_from_a_pipe_or_a_notebook_is_saved_whole(script, tmp_path):
    """`script.py 2>&1 | head -1` from a notebook cell: stdout and stderr closed once the first
    line is read (a BrokenPipeError at the next line, or the DQN's next progress line on
    stderr, used to lose the run), and the notebook's MPLBACKEND, which this environment lacks
    (matplotlib would not import). The run goes on and is saved whole, figures included, exit 0."""
    output = tmp_path / "run"
    argv = [sys.executable, "-u", script.__file__, *shlex.split(SHORT_RUNS[script])]
    process = subprocess.Popen(
        [*argv, "--output-dir", str(output)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "MPLBACKEND": "module://matplotlib_inline.backend_inline"},
    )  # fmt: skip
    assert process.stdout.readline()
    process.stdout.close()  # as head does: the lines still to come have no reader
    assert process.wait(timeout=300) == 0
    assert all((output / name).is_file() for name in script.RUN_FILES), sorted(output.iterdir())
    assert any(path.suffix == ".png" for path in output.iterdir()), sorted(output.iterdir())


def test_importing_a_script_leaves_the_importers_matplotlib_backend_alone(script, monkeypatch):
    """Agg is the command's choice (its `__main__`), not forced on a notebook that imports it."""
    monkeypatch.setenv("MPLBACKEND", "module://a_notebooks_own")
    spec = importlib.util.spec_from_file_location(f"fresh_{script.__name__}", script.__file__)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert os.environ["MPLBACKEND"] == "module://a_notebooks_own"


def test_an_output_stream_that_cannot_be_written_goes_to_dev_null(script):
    with open("/dev/full", "w") as full:  # every write: "No space left on device"
        stream = script.BestEffortStream(full)
        print("a line", file=stream, flush=True)  # no OSError
        print("another", file=stream, flush=True)
        assert os.path.samefile(f"/proc/self/fd/{full.fileno()}", os.devnull)


def test_a_stdout_that_cannot_be_written_is_said_once_unless_its_reader_left(
    script, monkeypatch, capsys
):
    """A full disk (`> /dev/full`) lost every result line without a word: now one line on
    stderr. A reader that left (`| head -1`) wanted no more lines: nothing said."""
    read, write = os.pipe()
    os.close(read)
    for target, said in (("/dev/full", 1), (write, 0)):
        with open(target, "w") as file:
            monkeypatch.setattr(sys, "stdout", script.BestEffortStream(file))
            for line in ("a line", "another"):
                print(line, flush=True)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == said and all("stdout cannot be written" in line for line in err), err


def test_an_output_dir_in_a_symlink_loop_is_one_line(script, tmp_path, capsys):
    (tmp_path / "loop").symlink_to("loop")  # pathlib's resolve() raised RuntimeError on it
    for output in ("loop", "loop/sub"):
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--output-dir", str(tmp_path / output)])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and "--output-dir" in err[0], err


def test_control_characters_in_a_folder_name_are_escaped_in_the_one_line(script, tmp_path, capsys):
    """A newline in --output-dir made the refusal two lines, and an ESC reached the terminal."""
    folder = tmp_path / "a\nb\x1b[31m"
    folder.mkdir()
    (folder / "notes.txt").touch()
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--output-dir", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "a\\nb\\x1b[31m" in err[0], err


@pytest.mark.parametrize("ignored", [signal.SIGHUP, signal.SIGINT], ids=["SIGHUP", "SIGINT"])
def test_a_signal_ignored_from_the_start_stays_ignored(script, ignored):
    """nohup's SIGHUP, or the SIGINT of a job that a non-interactive shell starts with `&`: what
    holds signals while a run is written (and the DQN's stop request while it trains) leaves it
    ignored, as `__main__` does (tested with nohup itself)."""
    previous = signal.signal(ignored, signal.SIG_IGN)
    try:
        with script.written_whole():
            assert signal.getsignal(ignored) is signal.SIG_IGN
        if hasattr(script, "StopRequest"):
            with script.StopRequest():
                assert signal.getsignal(ignored) is signal.SIG_IGN
                assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    finally:
        signal.signal(ignored, previous)


def test_an_abbreviation_that_fits_two_flags_is_one_line(script, tmp_path, capsys):
    """--num fits --num-seeds and others in each script (the DQN's --eval is tested there)."""
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--num", "5", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert "ambiguous option: --num could match" in err[0] and "--num-seeds" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_folder_name_the_terminal_cannot_show_is_printed_escaped(script):
    """A folder name with bytes that are not UTF-8 ('caf\\xe9', a surrogate to Python) under a
    strict UTF-8 stdout: printing 'output <folder>/' raised UnicodeEncodeError, a traceback
    just before training, and an empty folder was left."""
    raw = io.BytesIO()
    stream = script.BestEffortStream(io.TextIOWrapper(raw, encoding="utf-8", errors="strict"))
    folder = os.fsdecode(b"caf\xe9")  # as Path and os.listdir give it
    print(f"output {folder}/", file=stream)
    stream.flush()
    assert raw.getvalue() == b"output caf\\udce9/\n"


def test_the_watched_rank_is_the_process_id_main_reads(script, monkeypatch):
    """rank() decides whether this process is watched (other than 0); it read only ASCII digits,
    so "+1" or " 1", which main reads as process 1, went unwatched: process 1 then aborted with
    a C++ stack trace when process 0 ended. And --process-id without a value printed a usage line
    of rank()'s own parser before main's line."""
    if script is q_learning_gridworld:
        pytest.skip("one process, no cluster: no watcher")
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    for value, rank in (("1", 1), ("+1", 1), (" 1", 1), ("\u0661", 1), ("0", 0), ("x", 0)):
        assert script.rank(["--process-id", value]) == rank == (int(value) if rank else rank)
    assert script.rank(["--num-seeds", "3", "--process-id"]) == 0  # main says it, in one line
    monkeypatch.setenv("SLURM_PROCID", "+2")
    assert script.rank([]) == 2


def test_a_link_at_the_temporary_name_is_replaced_not_written_through(script, tmp_path):
    """A symbolic link left at the name a file is first written to (.summary.tmp.json): the write
    went through it, and --replot's figures replaced a file outside the run's folder (found by
    an adversarial pass). Now a new file takes the link's place."""
    elsewhere, run = tmp_path / "elsewhere.txt", tmp_path / "run"
    elsewhere.write_text("kept")
    run.mkdir()
    script.temporary(run / "summary.json").symlink_to(elsewhere)
    with script.atomic_open(run / "summary.json") as file:
        file.write("{}")
    assert elsewhere.read_text() == "kept" and (run / "summary.json").read_text() == "{}"
    assert not (run / "summary.json").is_symlink() and sorted(os.listdir(run)) == ["summary.json"]
