"""``pdserve cloud up`` and ``cloud down``: the preflight, then the plan; run them (or print them).

The preflight's read-only checks run first: a problem found there costs seconds, not a half-made cluster.
Its zone lookup also feeds the plan, because the ClusterConfig names the zones; a dry run shows the
lookup's command, and placeholders in the plan.
"""

from __future__ import annotations

from pdserve.access import API_KEYS_ENV
from pdserve.config import Settings
from pdserve.deploy.aws_preflight import ZONES_STEP, image_note, image_refusal, preflight_steps
from pdserve.deploy.cost import cost_lines, plan_charges
from pdserve.deploy.eks import API_KEYS_STEP, plan_down, plan_up, reach_lines
from pdserve.deploy.eksctl import Zones, choose_zones, unresolved_zones
from pdserve.deploy.k8s_names import API_KEYS_SECRET_KEYS, api_keys_secret_name
from pdserve.deploy.k8s_secrets import NewSecrets, read_back_command
from pdserve.deploy.runner import TOOL_SOURCES, Progress, capture, print_plan, require_tools, run_plan
from pdserve.deploy.stacks import billed, parse_stacks, stacks_query
from pdserve.errors import DeployError


def cloud_up(settings: Settings, *, is_dry_run: bool, progress: Progress, config: str = "") -> None:
    """Check, then bring the cluster and the app up, step by step, and say how to reach it; a re-run skips
    what is done. Raises DeployError (a refused image, a failed check, a tool missing, a step failing; once the
    cluster exists, with what still bills and how to remove it) or ConfigError. ``config``: the --config path."""
    refusal = image_refusal(settings)
    if is_dry_run:
        _print_up(settings, refusal=refusal, progress=progress)
        progress("while it runs, the plan costs per hour:")
        for line in cost_lines(plan_charges(settings.eks)):
            progress(line)
        progress(f"`{down_command(config)}` removes it")
        return
    if refusal:
        raise DeployError(f"nothing was created: {refusal}")
    require_tools(TOOL_SOURCES)
    progress("preflight: read-only checks before anything is created")
    outputs = run_plan(preflight_steps(settings), progress=progress)
    note = image_note(settings)
    if note:
        progress(note)
    zones = _zones(settings, outputs[ZONES_STEP], progress=progress)
    # fresh keys each time; the plan stores each only where its Secret does not exist yet
    new = NewSecrets.generate()
    try:
        outputs = run_plan(plan_up(settings, zones=zones, secrets=new), progress=progress)
    except DeployError as exc:
        raise DeployError(f"{exc}{_bill_note(settings, config=config)}") from exc
    if API_KEYS_STEP in outputs:
        progress(api_key_lines(settings, api_key=new.api_key))
    for line in reach_lines(settings):
        progress(line)


def api_key_lines(settings: Settings, *, api_key: str) -> str:
    """The client API key `up` just stored, shown this once, and the command that reads it back later."""
    spec = settings.kubernetes
    read_back = read_back_command(spec, secret=api_keys_secret_name(spec), key=API_KEYS_SECRET_KEYS[API_KEYS_ENV])
    return (f"API key for clients (shown once; stored in Secret {api_keys_secret_name(spec)}, with the admin key): "
            f"{api_key}\nread it back with: {read_back}")


def cloud_down(settings: Settings, *, is_dry_run: bool, progress: Progress, config: str = "") -> None:
    """Remove everything ``cloud_up`` made, in reverse; what is already gone is skipped. Says removed only
    what it saw go: a stack of the cluster still listed afterwards (a VPC left DELETE_FAILED) is a failure."""
    eks = settings.eks
    steps = plan_down(settings)
    if is_dry_run:
        print_plan(steps, progress=progress)
        return
    try:
        outputs = run_plan(steps, progress=progress)
    except DeployError as exc:
        raise DeployError(f"{exc}{_bill_note(settings, config=config)}") from exc
    left = parse_stacks(capture(stacks_query(eks), what="the stacks left after `cloud down`"))
    if left:
        stacks = ", ".join(f"{name} ({status})" for name, status in sorted(left.items()))
        raise DeployError(f"cloud down did not remove everything: {stacks} still listed; read why with `aws "
                          f"cloudformation describe-stack-events --stack-name NAME --region {eks.region}`"
                          f"{_bill_note(settings, config=config)}")
    ran = ", ".join(outputs) or "nothing (it was all gone already)"
    progress(f"cluster {eks.cluster_name} ({eks.region}): no stack of it is listed any more; removed this run: {ran}")


def down_command(config: str) -> str:
    return "pdserve cloud down" + (f" --config {config}" if config else "")


def _bill_note(settings: Settings, *, config: str) -> str:
    """What still bills by the hour, from the cluster's stacks, and the command that removes it ('' for nothing)."""
    try:
        charges = billed(settings.eks, capture(stacks_query(settings.eks), what="what still runs"))
        seen = "still running, billed by the hour"
    except DeployError:
        charges, seen = plan_charges(settings.eks), "the stacks could not be listed; what may still run"
    if not charges:
        return ""
    return "\n" + "\n".join([f"{seen}:", *cost_lines(charges), f"remove it with: {down_command(config)}"])


def _print_up(settings: Settings, *, refusal: str, progress: Progress) -> None:
    """The whole of ``up``, preflight first; a refused image is said where ``up`` would stop."""
    if refusal:
        progress(f"warning: `up` without --dry-run would stop here, before its first check: {refusal}")
    progress("preflight: read-only checks before anything is created; `up` stops at the first that fails")
    print_plan(preflight_steps(settings), progress=progress)
    note = image_note(settings)
    if note:
        progress(note)
    progress(f"then the plan, in the zones the {ZONES_STEP} check finds:")
    print_plan(plan_up(settings, zones=unresolved_zones(settings.eks), secrets=NewSecrets.generate()), progress=progress)
    if refusal:
        progress("warning: `up` without --dry-run would stop before its first check (see the top): a placeholder "
                 "in kubernetes.image")


def _zones(settings: Settings, offerings_json: str, *, progress: Progress) -> Zones:
    zones = choose_zones(offerings_json, settings.eks)
    later = f" (then {', '.join(zones.gpu[1:])}, if EC2 has no capacity there)" if len(zones.gpu) > 1 else ""
    progress(f"zones: GPU nodes in {zones.gpu[0]}{later}; cluster in {', '.join(zones.cluster)}")
    return zones
