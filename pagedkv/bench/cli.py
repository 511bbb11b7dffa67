"""`pagedkv bench`: W1/W2/W3 (and traces) through the offline engine or the server, one table out.

pagedkv bench                              # W1, W2, W3 offline with the flags given
pagedkv bench --suite --out r.json --plot plots/   # prefix on/off + allocation policies,
                                                   # all at equal memory
pagedkv bench --online --concurrency 16 --workloads W1
pagedkv bench --trace my.jsonl --shared-prefix 256
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys

from pagedkv.config import ConfigError, EngineConfig

# flags --from-json applies; it runs nothing, so any other flag set would be ignored
FROM_JSON_FLAGS = {"from_json", "out", "markdown", "plot"}
# the engine options --suite sets itself, per run; None: not given, so a given one is refused
SUITE_OPTIONS = ("allocation_policy", "enable_prefix_caching")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark the engine or the server on the shared workloads"
    )
    _add_args(p)
    p.set_defaults(func=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.cli import add_engine_args

    add_engine_args(p)
    p.set_defaults(**dict.fromkeys(SUITE_OPTIONS))
    _add_workload_args(p.add_argument_group("workloads"))
    _add_suite_args(p.add_argument_group("comparison suite"))
    _add_online_args(p.add_argument_group("online (through pagedkv serve)"))
    _add_output_args(p.add_argument_group("output"))


def _defaults() -> dict:
    """Every flag's value when not given: a value that differs was set on the command line."""
    from pagedkv.cli import Parser

    p = Parser(prog="pagedkv bench")
    _add_args(p)
    return vars(p.parse_args([]))


def _given(args: argparse.Namespace) -> set[str]:
    """The flags the command line set (by their dest), as far as a value tells."""
    defaults = _defaults()
    return {
        k
        for k, v in vars(args).items()
        if k in defaults and not (v == defaults[k] or v is defaults[k])  # nan is not nan's equal
    }


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _add_workload_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--workloads",
        default=None,
        help="comma-separated subset of W1,W2,W3 "
        "(default: all three, or none when --trace is given)",
    )
    g.add_argument(
        "--workloads-file",
        default=None,
        help="the shared workloads.py "
        "(default: ../shared/bench/workloads.py beside the repository)",
    )
    g.add_argument(
        "--trace", default=None, help='JSON lines {"prompt_tokens": P, "output_tokens": O}'
    )
    g.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens every trace prompt starts with"
    )
    g.add_argument(
        "--trace-seed", type=int, default=20261129, help="seed for the trace's random prompts"
    )


def _add_suite_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--suite",
        action="store_true",
        help="prefix caching on/off on every workload, and paged vs reserve-output vs "
        "reserve-max on W1 (or the trace) at one small KV budget",
    )
    g.add_argument(
        "--suite-pool-tokens", type=int, default=24576, help="the equal KV budget, in tokens"
    )
    g.add_argument(
        "--suite-max-model-len",
        type=int,
        default=2048,
        help="max_model_len of the equal-memory runs",
    )


def _add_online_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--online", action="store_true", help="start `pagedkv serve` and load it over HTTP"
    )
    g.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="at most N requests in flight (default: no limit)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    g.add_argument("--server-startup-timeout", type=float, default=600.0)


def _add_output_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--label", default=None, help="name of the configuration in the table (not with --suite)"
    )
    g.add_argument(
        "--out", default=None, help="write every figure, series and latency as JSON here"
    )
    g.add_argument("--markdown", default=None, help="write the markdown report here too")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into DIR")
    g.add_argument(
        "--peers-dir",
        default=None,
        help="peer result JSONs (default: $PEERS_RESULTS or /tmp/peers/results)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="run nothing: render the report, ratios and plots of an earlier --out file again",
    )


def _check(args: argparse.Namespace) -> None:
    given = _given(args)
    if args.from_json and given - FROM_JSON_FLAGS:
        flags = ", ".join(sorted(_flag(d) for d in given - FROM_JSON_FLAGS))
        raise ConfigError(
            f"--from-json runs nothing, so {flags} would have no effect: "
            "give only --out, --markdown and --plot with it"
        )
    _check_load(args, given)
    if args.suite and given & set(SUITE_OPTIONS):
        raise ConfigError(
            "--suite runs prefix caching on and off and every allocation policy itself: "
            "drop --allocation-policy and --[no-]enable-prefix-caching"
        )
    if args.suite and args.label:
        raise ConfigError("--label names a single configuration; --suite names its own")
    if args.suite_pool_tokens < args.block_size:
        raise ConfigError(
            f"--suite-pool-tokens must hold at least one block, got {args.suite_pool_tokens}"
        )


def _check_load(args: argparse.Namespace, given: set[str]) -> None:
    """The trace and online flags: each in range, and only where it has an effect."""
    if args.concurrency is not None and args.concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {args.concurrency}")
    if not args.request_rate > 0:
        raise ConfigError(f"--request-rate must be > 0, got {args.request_rate}")
    if (args.concurrency is not None or math.isfinite(args.request_rate)) and not args.online:
        raise ConfigError("--concurrency and --request-rate shape the online load: add --online")
    if not args.server_startup_timeout > 0:
        raise ConfigError(
            f"--server-startup-timeout must be > 0, got {args.server_startup_timeout}"
        )
    if "server_startup_timeout" in given and not args.online:
        raise ConfigError("--server-startup-timeout waits for the server: add --online")
    if "shared_prefix" in given and not args.trace:
        raise ConfigError("--shared-prefix shapes the trace's prompts: add --trace")
    arrivals = args.online and math.isfinite(args.request_rate)
    if "trace_seed" in given and not (args.trace or arrivals):
        raise ConfigError(
            "--trace-seed seeds the trace's prompts and the --request-rate arrivals: "
            "add --trace, or --online with --request-rate"
        )


def _base_options(args: argparse.Namespace) -> dict:
    """The engine options the command line set.

    Defaults are left out, so labels and flags stay short."""
    defaults = {f: EngineConfig.__dataclass_fields__[f].default for f in EngineConfig.field_names()}
    opts = {
        k: v
        for k, v in vars(args).items()
        if k in defaults and v is not None and v != defaults[k]  # None: a --suite option not given
    }
    EngineConfig.from_options(**opts)  # a bad flag fails here, before anything loads
    return opts


def _specs(args: argparse.Namespace, keys: list[str], base: dict, trace_key: str | None):
    from pagedkv.bench.suite import RunSpec, suite_specs

    if args.suite:
        equal = trace_key or ("W1" if "W1" in keys else None)
        return suite_specs(
            keys,
            equal_memory_workload=equal,
            pool_tokens=args.suite_pool_tokens,
            max_model_len=args.suite_max_model_len,
            block_size=args.block_size,
        )
    prefix = "on" if base.get("enable_prefix_caching", True) else "off"
    label = args.label or f"{base.get('allocation_policy', 'paged')}, prefix {prefix}"
    return [RunSpec(label, {}, tuple(keys))]


def run(args: argparse.Namespace) -> int:
    # everything the report needs is imported now: a long run must not pick up files edited
    # meanwhile
    from pagedkv.bench import plot, report  # noqa: F401
    from pagedkv.bench.workloads import load_workloads, read_trace

    _check(args)
    if args.from_json:
        _Session.from_document(args, args.from_json).finish()
        return 0
    base = _base_options(args)
    keys = [k.strip() for k in args.workloads.split(",") if k.strip()] if args.workloads else []
    if args.workloads is None and args.trace is None:
        keys = ["W1", "W2", "W3"]
    workloads = {w.key: w for w in load_workloads(keys, args.workloads_file)}
    trace_key = None
    if args.trace:
        from pagedkv.bench.online import model_vocab_size

        trace = read_trace(
            args.trace, args.shared_prefix, args.trace_seed
        )  # checked before the model loads
        wl = trace.workload(model_vocab_size(base.get("model")))
        if wl.key in workloads:
            raise ConfigError(
                f"the trace's name {wl.key!r} clashes with a built-in workload; rename the file"
            )
        workloads[wl.key], trace_key = wl, wl.key
    if not workloads:
        raise ConfigError("no workload to run: give --workloads or --trace")
    specs = _specs(args, list(workloads), base, trace_key)
    session = _Session(args, base, list(workloads.values()))
    runner = _run_online if args.online else _run_offline
    runner(args, base, specs, workloads, session.add)
    session.finish()
    return 0


def _run_offline(args, base: dict, specs, workloads: dict, on_result) -> None:
    from pagedkv.bench.offline import EngineFactory, run_offline

    factory = EngineFactory(base)
    for spec in specs:
        for key in spec.workloads:
            engine = factory.build(**spec.overrides)
            result = run_offline(
                engine, workloads[key], spec.label, spec.overrides, progress=not args.no_progress
            )
            result.extra["model_load_s"] = factory.load_s
            on_result(result)
            del engine
            gc.collect()


def _run_online(args, base: dict, specs, workloads: dict, on_result) -> None:
    from pagedkv.bench.online import LoadSpec, ServerProcess, model_vocab_size, run_online

    vocab = model_vocab_size(base.get("model"))
    load = LoadSpec(args.concurrency, args.request_rate, args.trace_seed)
    for spec in specs:
        with ServerProcess({**base, **spec.overrides}, args.server_startup_timeout) as server:
            for key in spec.workloads:
                on_result(
                    run_online(
                        server,
                        workloads[key],
                        spec.label,
                        spec.overrides,
                        load,
                        vocab,
                        progress=not args.no_progress,
                    )
                )


class _Session:
    """Collects the runs; after each one it rewrites --out.

    So a long suite never loses the runs it has finished."""

    def __init__(self, args: argparse.Namespace, base: dict, workloads: list) -> None:
        from pagedkv.bench.metrics import git_commit, machine_info
        from pagedkv.bench.peers import load_peers

        self.args, self.base = args, base
        self.summaries = [w.summary() for w in workloads]
        self.peers = load_peers(args.peers_dir)
        self.machine, self.commit, self.command = machine_info(), git_commit(), list(sys.argv)
        self.results: list = []

    @classmethod
    def from_document(cls, args: argparse.Namespace, path: str) -> _Session:
        """The session an earlier --out file describes (its runs, peers and suite settings)."""
        from pagedkv.bench.peers import PeerFigures
        from pagedkv.bench.result import RunResult

        try:
            with open(path) as f:
                doc = json.load(f)
            session = cls.__new__(cls)
            session.args, session.base = args, doc["settings"]["engine_options"]
            session.summaries, session.machine = doc["workloads"], doc["machine"]
            session.commit, session.command = doc["commit"], doc["command"]
            session.peers = [PeerFigures(**p) for p in doc["peers"]]
            session.results = [RunResult.from_json(r) for r in doc["runs"]]
            for key in (
                "suite",
                "suite_pool_tokens",
                "suite_max_model_len",
                "online",
                "concurrency",
            ):
                setattr(args, key, doc["settings"][key])
            args.request_rate = doc["settings"]["request_rate"] or math.inf
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"--from-json {path}: not a pagedkv bench result ({type(e).__name__}: {e})"
            ) from None
        return session

    def add(self, result) -> None:
        from tqdm import tqdm

        self.results.append(result)
        tqdm.write(_one_line(result), file=sys.stderr)
        if self.args.out:
            self._write_json(complete=False)

    def finish(self) -> None:
        from pagedkv.bench import report

        text = report.markdown(self.results, self.peers, self._ratios(), self.summaries)
        print(text)
        if self.args.markdown:
            with open(self.args.markdown, "w") as f:
                f.write(text)
        if self.args.out:
            self._write_json(complete=True)
        if self.args.plot:
            from pagedkv.bench.plot import plot_all

            for path in plot_all(self.results, self.args.plot):
                print(f"wrote {path}", file=sys.stderr)

    def _ratios(self) -> list:
        from pagedkv.bench.suite import suite_ratios

        return (
            suite_ratios(self.results, self.peers, self.args.suite_pool_tokens)
            if self.args.suite
            else []
        )

    def _write_json(self, complete: bool) -> None:
        from pagedkv.bench import report

        a = self.args
        settings = {
            "engine_options": self.base,
            "online": a.online,
            "concurrency": a.concurrency,
            "request_rate": None if math.isinf(a.request_rate) else a.request_rate,
            "suite": a.suite,
            "suite_pool_tokens": a.suite_pool_tokens,
            "suite_max_model_len": a.suite_max_model_len,
        }
        doc = report.build_document(
            command=self.command,
            machine=self.machine,
            commit=self.commit,
            workloads=self.summaries,
            results=self.results,
            peers=self.peers,
            ratios=self._ratios(),
            settings=settings,
        )
        doc["complete"] = complete
        report.write_json(doc, a.out)


def _one_line(r) -> str:
    return (
        f"{r.workload} {r.label} ({r.mode}): {r.output_tok_s:.1f} out tok/s, {r.wall_s:.1f}s, "
        f"peak running {r.peak_running}, preemptions {r.preemptions}"
        + (f", {r.errors} errors" if r.errors else "")
    )
