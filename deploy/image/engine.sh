# shellcheck shell=bash
# Sourced by build.sh and smoke.sh: picks podman or docker and the options this host needs.
# Sets ENGINE (the name), ENGINE_CMD (the command with its global options) and RUN_OPTS
# (options for `build` and `run`: a build's RUN steps are containers too).

die() {
    echo "${0##*/}: $*" >&2
    exit 1
}

_engine_works() {
    command -v "$1" >/dev/null 2>&1 && "$1" info >/dev/null 2>&1
}

# Raising a resource limit above this shell's hard limit needs CAP_SYS_RESOURCE.
_has_cap_sys_resource() {
    local eff
    eff=$(awk '/^CapEff:/ {print $2}' /proc/self/status 2>/dev/null) || return 0
    [[ -n $eff ]] || return 0
    (((16#$eff >> 24) & 1))
}

# podman (daemonless) starts containers under this shell's limits, and its default nofile
# and nproc are above them: without CAP_SYS_RESOURCE (a sandboxed root) runc and crun then
# fail with "setrlimit ...: operation not permitted". Ask for what we have; podman runs
# itself under nproc 32768, so no container gets more than that.
_default_ulimits() {
    [[ $ENGINE == podman ]] || return 0
    _has_cap_sys_resource && return 0
    local nofile nproc
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    [[ $nofile == unlimited || $nofile -gt 1048576 ]] && nofile=1048576
    [[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
    echo "nofile=$nofile:$nofile nproc=$nproc:$nproc"
}

engine_init() {
    ENGINE=${IMAGE_ENGINE:-}
    if [[ -z $ENGINE ]]; then
        # podman first: it needs no daemon and keeps the HEALTHCHECK with --format docker.
        if _engine_works podman; then
            ENGINE=podman
        elif _engine_works docker; then
            ENGINE=docker
        else
            die "neither podman nor docker works here ('podman info' and 'docker info' failed)"
        fi
    fi
    [[ $ENGINE == podman || $ENGINE == docker ]] || die "IMAGE_ENGINE must be podman or docker"
    local -a opts=()
    read -ra opts <<<"${IMAGE_ENGINE_OPTS:-}"
    ENGINE_CMD=("$ENGINE" "${opts[@]}")
    if [[ $ENGINE == podman ]]; then
        # crun (podman's default on Debian) refuses hosts with cgroup v1 and v2 mounted
        # side by side ("cgroups in hybrid mode not supported"); runc handles every layout.
        local runtime=${IMAGE_OCI_RUNTIME-$(command -v runc >/dev/null && echo runc)}
        [[ -n $runtime ]] && ENGINE_CMD+=(--runtime "$runtime")
    fi
    RUN_OPTS=()
    local limit
    for limit in ${IMAGE_ULIMITS-$(_default_ulimits)}; do
        RUN_OPTS+=(--ulimit "$limit")
    done
}

# The help text both scripts print for the variables above.
# shellcheck disable=SC2034  # read by the scripts that source this file
ENGINE_ENV_HELP='Environment (both scripts):
  IMAGE_ENGINE       podman or docker (default: podman when "podman info" works, else docker)
  IMAGE_ENGINE_OPTS  global options for every engine command, e.g. for a podman that cannot
                     use overlayfs or journald here:
                     "--storage-driver vfs --cgroup-manager cgroupfs --events-backend file"
  IMAGE_OCI_RUNTIME  podman --runtime (default: runc when installed, since crun refuses hosts
                     with cgroup v1 and v2 mounted together); empty: podman'"'"'s own choice
  IMAGE_ULIMITS      --ulimit values for build steps and containers, space-separated
                     (default for podman without CAP_SYS_RESOURCE: this shell'"'"'s hard
                     limits, e.g. "nofile=20000:20000 nproc=32768:32768"; otherwise none);
                     empty: the engine'"'"'s defaults'
