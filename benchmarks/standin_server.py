"""`trajflow serve` over the engine stand-in (`benchmarks/engine_standin.py`), with a probe of the server's own costs.

    python -m benchmarks.standin_server [--decode-base-ms X ...] -- serve --model FOLDER [trajflow serve flags]

Runs `flows.cli.main(["serve", ...])`, i.e. the very path of ``trajflow serve`` (its uvicorn, its app, its engine
built by `Engine.from_pretrained`), with two changes made from outside: the engine's model computation is replaced
by the stand-in right after it is built, and the app gets two extra routes for the benchmark:

- ``GET /bench/stats``: CPU seconds of every thread of the process by role (event loop, engine, tokenizer pool,
  other workers; from ``/proc/self/task/<tid>/stat``), the event loop's lag (a probe task asks to wake every
  `LAG_TICK_S` and records how late it wakes), the engine's and the stand-in's counters.
- ``POST /bench/reset``: zero the lag record and the stand-in's counters (CPU times are read as differences).
- ``POST /bench/profile?path=FILE``: start cProfile on the event loop's thread; the next call stops it and writes
  its stats to FILE (``pstats``): what the loop spends its time on (threads other than the loop are not seen).
- ``GET /bench/intake``: the per-request timelines recorded since the last call (`benchmarks/intake_clock.py`), and
  forgets them.

Benchmarks only; the product never imports this.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_standin import StandInTiming, install
from benchmarks.intake_clock import IntakeClock, IntakeMiddleware

LAG_TICK_S = 0.005
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, summed by role."""
    roles: dict[str, float] = {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().native_id
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        name = names.get(int(tid), "native")
        role = ("event_loop" if int(tid) == main_id else "engine" if name.startswith("engine-") else
                "tokenizer_pool" if name.startswith("tokenize") else "native" if name == "native" else "other")
        roles[role] = roles.get(role, 0.0) + seconds
    return roles


def process_cpu() -> float:
    t = os.times()
    return t.user + t.system


class GcClock:
    """Collections and seconds spent in the cyclic garbage collector, per generation (`gc.callbacks`)."""

    def __init__(self):
        import gc

        self.counts, self.seconds, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t0

    def snapshot(self) -> dict:
        return {"collections": list(self.counts), "seconds": [round(x, 4) for x in self.seconds]}


class LagProbe:
    """Wakes every LAG_TICK_S on the event loop and records how late each wake-up is."""

    def __init__(self):
        self.lags: list[float] = []
        self.task = None

    def ensure_running(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            self.lags.append(time.perf_counter() - t0 - LAG_TICK_S)

    def summary(self) -> dict:
        v = sorted(self.lags)
        if not v:
            return {}
        pick = lambda q: round(1000 * v[min(len(v) - 1, int(q * len(v)))], 3)
        return {"ticks": len(v), "mean_ms": round(1000 * sum(v) / len(v), 3), "p50_ms": pick(0.5),
                "p99_ms": pick(0.99), "max_ms": round(1000 * v[-1], 3), "over_10ms": sum(x > 0.010 for x in v)}


def instrument(timing: StandInTiming, keep_alive_s: float | None = None, http: str | None = None,
               overlap_decode: bool | None = None) -> None:
    """Patch `Engine.from_pretrained` (stand-in) and `create_app` (probe routes) before `trajflow serve` runs;
    `keep_alive_s` replaces the server's keep-alive timeout, `http` uvicorn's HTTP parser, `overlap_decode` the
    engine's choice (to show what they do)."""

    from backends.inference.engine import Engine, EngineConfig
    from backends.serving import app as app_module

    original_load, original_create = Engine.from_pretrained.__func__, app_module.create_app

    def from_pretrained(cls, *args, **kwargs):
        if overlap_decode is not None:
            config = kwargs.get("config") or EngineConfig()
            kwargs["config"] = config.model_copy(update={"overlap_decode": overlap_decode})
        engine = original_load(cls, *args, **kwargs)
        install(engine, timing)
        return engine

    def create_app(engine, *args, **kwargs):
        app = original_create(engine, *args, **kwargs)
        probe, gc_clock, intake = LagProbe(), GcClock(), IntakeClock()
        intake.wrap_engine(engine)
        app.add_middleware(IntakeMiddleware, clock=intake)

        async def stats():
            probe.ensure_running()
            counters = engine.standin["counters"]
            with counters.lock:
                standin = counters.snapshot()
            return {"threads_cpu_s": thread_cpu(), "process_cpu_s": process_cpu(), "wall": time.perf_counter(),
                    "lag": probe.summary(), "gc": gc_clock.snapshot(), "engine": dict(engine.stats), "standin": standin,
                    "timing": engine.standin["timing"], "token_ids": engine.standin["token_ids"],
                    "switch_interval_s": sys.getswitchinterval(), "loop": type(asyncio.get_running_loop()).__module__}

        async def reset():
            probe.ensure_running()
            probe.lags.clear()
            with engine.standin["counters"].lock:
                engine.standin["counters"].reset()
            return {}

        profiler = {}

        async def profile(path: str):
            import cProfile

            if "on" not in profiler:
                profiler["on"] = cProfile.Profile()
                profiler["on"].enable()
                return {"profiling": True}
            profiler["on"].disable()
            profiler.pop("on").dump_stats(path)
            return {"profiling": False, "path": path}

        async def timelines():
            return intake.take()

        # no key: the benchmark serves on 127.0.0.1 without one
        app.add_api_route("/bench/stats", stats, methods=["GET"])
        app.add_api_route("/bench/intake", timelines, methods=["GET"])
        app.add_api_route("/bench/profile", profile, methods=["POST"])
        app.add_api_route("/bench/reset", reset, methods=["POST"])
        return app

    Engine.from_pretrained = classmethod(from_pretrained)
    app_module.create_app = create_app
    if keep_alive_s is not None:
        app_module.KEEP_ALIVE_S = keep_alive_s
    if http is not None:
        original_config = app_module.server_config

        def server_config(*args, **kwargs):
            config = original_config(*args, **kwargs)
            config.http = http  # "h11": what uvicorn runs where httptools is not installed
            return config

        app_module.server_config = server_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in vars(StandInTiming()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=value)
    ap.add_argument("--keep-alive-s", type=float, default=None, help="the server's keep-alive timeout instead of "
                                                                      "its own")
    ap.add_argument("--http", choices=("h11", "httptools"), default=None, help="uvicorn's HTTP parser (default: "
                                                                                "httptools when installed)")
    ap.add_argument("--overlap-decode", choices=("on", "off"), default=None, help="EngineConfig.overlap_decode "
                                                                                   "(default: the engine's)")
    ap.add_argument("serve_argv", nargs=argparse.REMAINDER, help="-- serve --model FOLDER ...")
    args = ap.parse_args(argv)
    rest = args.serve_argv[1:] if args.serve_argv[:1] == ["--"] else args.serve_argv
    instrument(StandInTiming(**{k: getattr(args, k) for k in vars(StandInTiming())}), args.keep_alive_s, args.http,
               None if args.overlap_decode is None else args.overlap_decode == "on")
    from flows.cli import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main())
