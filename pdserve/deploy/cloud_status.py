"""``pdserve cloud status``: pods and their nodes, GPU and EFA per node, the Serve app and why a deployment
failed, the checks the gateway answers through a ``kubectl port-forward`` (among them ``kv-link``: PD requests
sized from the served model's KV, timed by the decode engine's own NIXL counters and judged against a bar
that tells EFA from TCP: kv_link_row.py), and the NIXL backend each engine logged (one
``kubectl exec ... grep`` per engine pod). The engines listen on pod addresses inside the cluster, so
``pdserve verify``'s engine-to-engine probe cannot run from here and is reported skipped.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdserve.access import load_access_keys
from pdserve.config import Settings
from pdserve.deploy.cluster_view import (
    APP_HEADER,
    NODE_HEADER,
    POD_HEADER,
    Check,
    app_rows,
    deployment_causes,
    engine_pods,
    format_table,
    node_rows,
    pod_rows,
)
from pdserve.deploy.eks import kubeconfig_argv, kubectl
from pdserve.deploy.k8s import kubernetes_settings
from pdserve.deploy.k8s_names import GATEWAY_PORT_NAME, gateway_service_name
from pdserve.deploy.kv_link_row import (
    KV_LINK_CHECK,
    KV_LINK_EFA_ADVICE,
    KV_LINK_FIRST_PROMPT_TOKENS,
    KV_LINK_MAX_PROBES,
    is_probe_done,
    kv_link_bar,
    kv_link_check,
    kv_link_max_prompt_tokens,
    kv_moved,
    next_probe_tokens,
)
from pdserve.deploy.runner import Progress, capture, require_tools
from pdserve.engines.kv_link import is_efa_asked
from pdserve.engines.kv_path import BUFFER_NOTE, NOTE_PREFIX, KvPath, kv_path_from_log
from pdserve.errors import DeployError
from pdserve.gateway.kv_monitor import check_window, gateway_bar
from pdserve.pd.pair import COMPLETIONS
from pdserve.pd.transfer_stats import TransferCounters
from pdserve.protocol import PD_MODE_HEADER
from pdserve.role import Role
from pdserve.routing.decision import Mode
from pdserve.verify.probe import pd_and_local_token_ids, probe_token_ids

PORT_FORWARD_TIMEOUT_S = 30.0
EXEC_TIMEOUT_S = 30.0
CHECK_HEADER = ("CHECK", "RESULT", "DETAIL")
NIXL_CHECK = "nixl-backend"
KV_LINK_POLL_INTERVAL_S = 1.0
WORKER_CONTAINER = "ray-worker"  # the engine's container in each worker pod (deploy/rayservice.py)
RAY_TMP = "/tmp/ray/"  # Ray's session logs, where a replica's output lands
# One extended regex, so one exec per pod reads all of it: NIXL's "Backend %s was instantiated" (its Python
# API, nixl _api.py), pdserve's note of where it put the KV buffer (engines/launcher.py) and NIXL's INFO line
# naming the libfabric provider it opened (kv_path.OPENED_PROVIDER; the engines run at NIXL_LOG_LEVEL=INFO).
# Also a valid Python regex, so stand-ins can apply it.
KV_PATH_PATTERN = "|".join(("Backend [A-Z_]+ was instantiated", f"{NOTE_PREFIX}{BUFFER_NOTE} .*",
                            "[0-9]+ rails using provider=[A-Za-z0-9_-]+"))
# kubectl exec's stderr when the command ran and exited non-zero (it exits with that code too): grep's 1 is
# "no line matched" and 2 "a path was unreadable"; any other failure is kubectl's own (no such pod, forbidden).
_GREP_ANSWERED = re.compile(r"command terminated with exit code [12]\b")
_FORWARDING = re.compile(rb"Forwarding from 127\.0\.0\.1:(\d+)")
# the gateway's samples of the decode engines' counters (gateway/metrics.py) -> TransferCounters fields
_KV_SAMPLES = {"pdserve_engine_kv_transfer_bytes_total": "bytes", "pdserve_engine_kv_transfer_seconds_total": "seconds",
               "pdserve_engine_kv_transfers_total": "transfers", "pdserve_engine_kv_transfer_failures_total": "failed"}


_ENGINE_PROBE = Check("engine-probe", "SKIPPED", "engines listen inside the cluster only; the KV rows above are "
                                                 "the decode engines' own counters, read by the gateway")


def cloud_status(settings: Settings, *, progress: Progress, timeout_s: float = 120.0) -> bool:
    """Print the pods, nodes, Serve apps (with why a deployment failed), the gateway's checks and each
    engine pod's NIXL backend; True when the app serves and every check that ran passed. Raises
    DeployError when kubectl cannot reach the cluster."""
    spec = settings.kubernetes
    require_tools({"aws", "kubectl"})
    capture(kubeconfig_argv(settings), what="kubeconfig")
    in_namespace = ("--namespace", spec.namespace)
    pods = capture(kubectl(settings, "get", "pods", *in_namespace, "-o", "json"), what="pods")
    nodes = capture(kubectl(settings, "get", "nodes", "-o", "json"), what="nodes")
    rayservice = capture(kubectl(settings, "get", "rayservice", spec.name, *in_namespace, "-o", "json"),
                         what=f"RayService {spec.name}")
    is_serving, apps = app_rows(rayservice)
    app_table = "\n".join([format_table(APP_HEADER, apps), *deployment_causes(rayservice)])
    for table in (format_table(POD_HEADER, pod_rows(pods)), format_table(NODE_HEADER, node_rows(nodes)), app_table):
        progress(table + "\n")
    if not is_serving:
        progress("not serving yet: gateway checks skipped")
        return False
    checks = asyncio.run(_checks(settings, engine_pods(pods, instance=spec.name), timeout_s=timeout_s))
    progress(format_table(CHECK_HEADER, [(check.name, check.result, check.detail) for check in checks]))
    return all(check.result != "FAIL" for check in checks)


async def _checks(settings: Settings, engines: Sequence[str], *, timeout_s: float) -> list[Check]:
    """The gateway's checks and each engine pod's NIXL backend, read side by side."""
    cluster = kubernetes_settings(settings)  # the backends and provider the cluster runs with
    expected = cluster.kv.backends
    provider = "efa" if is_efa_asked(cluster.kv, tuple(cluster.pool(role) for role in Role)) else ""
    exec_timeout_s = min(timeout_s, EXEC_TIMEOUT_S)
    through_gateway, backends = await asyncio.gather(
        _checks_through_gateway(settings, timeout_s=timeout_s),
        asyncio.gather(*(_backend_check(cluster, pod, expected=expected, provider=provider,
                                        timeout_s=exec_timeout_s) for pod in engines)),
    )
    return [*through_gateway, *backends, _ENGINE_PROBE]


async def _checks_through_gateway(settings: Settings, *, timeout_s: float) -> list[Check]:
    async with port_forward(settings) as gateway_url, aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s), headers=load_access_keys(settings.gateway).headers()
    ) as session:
        checks = [await _health(session, gateway_url), await _pd_matches_local(session, gateway_url, settings,
                                                                                 timeout_s=timeout_s)]
        checks += await _kv_transfers(session, gateway_url, settings)
        checks.append(await _kv_link(session, gateway_url, settings))
    return checks


@asynccontextmanager
async def port_forward(settings: Settings) -> AsyncIterator[str]:
    """``kubectl port-forward`` to the gateway's Service on a free local port; yields its URL."""
    spec = settings.kubernetes
    argv = kubectl(settings, "port-forward", f"svc/{gateway_service_name(spec)}", "--namespace", spec.namespace,
                   "--address", "127.0.0.1", f":{GATEWAY_PORT_NAME}")
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stderr is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), PORT_FORWARD_TIMEOUT_S)
        except TimeoutError:
            line = b""
        match = _FORWARDING.search(line)
        if match is None:
            if process.returncode is None:
                process.kill()
            error = (await process.stderr.read()).decode(errors="replace").strip()
            raise DeployError(f"kubectl port-forward to the gateway failed: {error or line.decode().strip()}")
        yield f"http://127.0.0.1:{match.group(1).decode()}"
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


async def _health(session: aiohttp.ClientSession, gateway_url: str) -> Check:
    try:
        async with session.get(gateway_url + "/health") as reply:
            body = (await reply.text()).strip()
            return Check("gateway", "OK" if reply.status == 200 else "FAIL", f"/health {reply.status} {body}"[:100])
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Check("gateway", "FAIL", f"/health: {exc!r}")


async def _pd_matches_local(
    session: aiohttp.ClientSession, gateway_url: str, settings: Settings, *, timeout_s: float,
) -> Check:
    """Greedy output through both legs and through one engine alone must be token-identical."""
    try:
        pd, local = await pd_and_local_token_ids(session, gateway_url, model=settings.model.served_name,
                                                 timeout_s=timeout_s)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Check("pd==local", "FAIL", repr(exc))
    if pd == local:
        return Check("pd==local", "OK", f"{len(pd)} greedy tokens identical")
    first = next((index for index, pair in enumerate(zip(pd, local, strict=False)) if pair[0] != pair[1]),
                 min(len(pd), len(local)))
    return Check("pd==local", "FAIL", f"greedy outputs differ from token {first}")


async def _kv_transfers(session: aiohttp.ClientSession, gateway_url: str, settings: Settings) -> list[Check]:
    """One row per decode engine: KV moved so far, and a FAIL if transfers failed or ran slow."""
    try:
        counters = await _read_kv_counters(session, gateway_url)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return [Check("kv-transfers", "FAIL", f"/metrics: {exc!r}")]
    if not counters:
        return [Check("kv-transfers", "SKIPPED", "the gateway has not read any decode engine's counters yet")]
    spec = settings.gateway
    checks = []
    for url, total in sorted(counters.items()):
        warning = check_window(url, total, bar=gateway_bar(spec))
        checks.append(Check("kv-transfers", "FAIL" if warning else "OK", warning or (
            f"{url}: {total.transfers:.0f} transfers, {total.bytes / 1e6:.1f} MB at {total.gbps:.3g} GB/s")))
    return checks


async def _kv_link(session: aiohttp.ClientSession, gateway_url: str, settings: Settings) -> Check:
    """The KV path as requests take it: PD requests through the gateway, judged by what the decode engine's
    NIXL counters moved for them (NCCL's all_reduce_perf would time NCCL's path, not NIXL's). Up to
    KV_LINK_MAX_PROBES prompts, each sized from what the last moved (kv_link_row), the last one judged."""
    max_tokens = kv_link_max_prompt_tokens(settings.model.max_model_len)
    prompt_tokens = min(KV_LINK_FIRST_PROMPT_TOKENS, max_tokens)
    # the gateway re-reads the engines' counters every kv_scrape_interval_s: two reads and slack
    within_s = 2 * settings.gateway.kv_scrape_interval_s + 5
    sizes: list[tuple[int, float]] = []
    for _ in range(KV_LINK_MAX_PROBES):
        try:
            before, after = await _kv_probe(session, gateway_url, settings, prompt_tokens=prompt_tokens,
                                            within_s=within_s)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Check(KV_LINK_CHECK, "FAIL", f"PD request of {prompt_tokens} tokens: {exc!r}")
        moved = kv_moved(before, after)
        if is_probe_done(moved, prompt_tokens=prompt_tokens, max_tokens=max_tokens):
            break
        sizes.append((prompt_tokens, max(delta.bytes for delta in moved.values())))
        prompt_tokens = next_probe_tokens(sizes, max_tokens=max_tokens)
    return kv_link_check(before, after, bar=kv_link_bar(settings), prompt_tokens=prompt_tokens, waited_s=within_s)


async def _kv_probe(session: aiohttp.ClientSession, gateway_url: str, settings: Settings, *, prompt_tokens: int,
                    within_s: float) -> tuple[dict[str, TransferCounters], dict[str, TransferCounters]]:
    """The gateway's KV counters before and after one PD request of a fresh ``prompt_tokens``-token prompt
    (one the decode engine has cached would not be transferred)."""
    prompt = probe_token_ids(prompt_tokens, seed=random.getrandbits(64))
    before = await _read_kv_counters(session, gateway_url)
    await _post_pd_completion(session, gateway_url, model=settings.model.served_name, prompt=prompt)
    return before, await _counters_after_a_transfer(session, gateway_url, before, within_s=within_s)


async def _post_pd_completion(session: aiohttp.ClientSession, gateway_url: str, *, model: str,
                              prompt: list[int]) -> None:
    """One completion through both legs, one output token; raises aiohttp.ClientError on a non-2xx reply."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(gateway_url + COMPLETIONS, json=body, headers={PD_MODE_HEADER: Mode.PD.value}) as reply:
        reply.raise_for_status()


async def _counters_after_a_transfer(
    session: aiohttp.ClientSession, gateway_url: str, before: dict[str, TransferCounters], *, within_s: float,
) -> dict[str, TransferCounters]:
    """The gateway's KV counters once some decode engine counts a transfer since ``before``, else after
    ``within_s``: they lag the engines by up to one scrape."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + within_s
    while True:
        after = await _read_kv_counters(session, gateway_url)
        if kv_moved(before, after) or loop.time() >= deadline_s:
            return after
        await asyncio.sleep(KV_LINK_POLL_INTERVAL_S)


async def _backend_check(settings: Settings, pod: str, *, expected: Sequence[str], provider: str,
                         timeout_s: float) -> Check:
    """``pod``'s nixl-backend row from one ``kubectl exec ... grep``, against the ``expected`` backends and
    libfabric ``provider``."""
    try:
        exit_code, stdout, stderr = await _run(backend_grep_argv(settings, pod), timeout_s=timeout_s)
    except TimeoutError:
        return Check(NIXL_CHECK, "SKIPPED", f"{pod}: kubectl exec did not finish in {timeout_s:.0f}s")
    return exec_check(pod, exit_code=exit_code, stdout=stdout, stderr=stderr, expected=expected, provider=provider)


def backend_grep_argv(settings: Settings, pod: str) -> tuple[str, ...]:
    """``kubectl exec`` into ``pod``'s engine container: grep Ray's logs and the engine log dir (of ``settings`` as
    the cluster runs them, k8s.kubernetes_settings: on the pods' writable volume) for the lines that tell the KV
    path. ``-a``: a log with a stray NUL is still
    read as text; ``-s``, ``--devices=skip``: Ray's sockets and unreadable files are neither read nor reported."""
    spec = settings.kubernetes
    log_dir = settings.engine_log_dir
    paths = [RAY_TMP] if log_dir.is_relative_to(RAY_TMP) else [RAY_TMP, str(log_dir)]
    return kubectl(settings, "exec", "--namespace", spec.namespace, pod, "-c", WORKER_CONTAINER, "--",
                   "grep", "-rhoaEs", "--devices=skip", KV_PATH_PATTERN, *paths)


def exec_check(pod: str, *, exit_code: int, stdout: str, stderr: str, expected: Sequence[str],
               provider: str = "") -> Check:
    """Pure: the row for one ``kubectl exec ... grep``. Judged on grep's answer (lines, or exit 1 or 2 when
    none matched); SKIPPED, saying why, when kubectl never got one, which says nothing of the backend."""
    if stdout.strip() or _GREP_ANSWERED.search(stderr):
        return backend_check(pod, stdout, expected=expected, provider=provider)
    why = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {exit_code} and no output"
    return Check(NIXL_CHECK, "SKIPPED", f"{pod}: kubectl exec gave no answer from grep: {why}")


def backend_check(pod: str, grep_output: str, *, expected: Sequence[str], provider: str = "") -> Check:
    """Pure: OK when every backend of ``expected`` (kv.backends as the cluster runs it) was instantiated in
    ``pod``'s engine, per ``grep_output`` (its log lines ``KV_PATH_PATTERN`` matched), and LIBFABRIC, where
    NIXL reported its provider, opened ``provider`` ("" = any); else FAIL naming what was instantiated or
    opened instead, or that nothing was."""
    path = kv_path_from_log(grep_output)
    if all(backend in path.backends for backend in expected):
        if provider and path.provider and path.provider != provider:
            return Check(NIXL_CHECK, "FAIL", f"{pod}: {_described(path)}: NIXL opened libfabric's {path.provider} "
                                             f"provider, not {provider} ({KV_LINK_EFA_ADVICE})")
        return Check(NIXL_CHECK, "OK", f"{pod}: {_described(path)}")
    if not path.backends:
        return Check(NIXL_CHECK, "FAIL", f"{pod}: no NIXL backend was instantiated (no 'Backend ... was "
                                         "instantiated' line in its logs)")
    return Check(NIXL_CHECK, "FAIL", f"{pod}: {'+'.join(path.backends)} only: {_fallback_reason(expected, path)}")


def _described(path: KvPath) -> str:
    """``LIBFABRIC (provider efa, kv buffer cpu)``: the backends, the provider NIXL said it opened (LIBFABRIC
    only; "provider not reported" without NIXL's line, never the FI_PROVIDER pdserve set), where the KV
    buffer is."""
    details = [f"provider {path.provider or 'not reported'}"] if "LIBFABRIC" in path.backends else []
    details += [f"kv buffer {path.buffer_device}"] if path.buffer_device else []
    return "+".join(path.backends) + (f" ({', '.join(details)})" if details else "")


def _fallback_reason(expected: Sequence[str], path: KvPath) -> str:
    if "LIBFABRIC" in expected and "UCX" in path.backends:
        return "NIXL fell back to UCX, which runs at TCP speed on EFA"
    return f"kv.backends asks for {'+'.join(expected)}"


async def _run(argv: Sequence[str], *, timeout_s: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a command; raises TimeoutError after ``timeout_s``, the command killed."""
    process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await process.communicate()
    finally:
        if process.returncode is None:  # timed out, or the status run was cancelled
            process.kill()
            await process.wait()
    assert process.returncode is not None  # communicate() returned: the process has exited
    return process.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")


async def _read_kv_counters(session: aiohttp.ClientSession, gateway_url: str) -> dict[str, TransferCounters]:
    """The gateway's samples of each decode engine's KV counters; raises aiohttp.ClientError or TimeoutError."""
    async with session.get(gateway_url + "/metrics") as reply:
        reply.raise_for_status()
        return kv_counters(await reply.text())


def kv_counters(metrics_text: str) -> dict[str, TransferCounters]:
    """Decode engine URL -> its KV counters, from the gateway's Prometheus text. Pure."""
    fields: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            field = _KV_SAMPLES.get(sample.name)
            if field:
                fields.setdefault(sample.labels["endpoint"], {})[field] = sample.value
    return {url: TransferCounters(**values) for url, values in fields.items()}
