#!/usr/bin/env bash
# Builds the tandem image (the repository's Dockerfile) with podman or docker.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=deploy/image/engine.sh
source "$HERE/engine.sh"

DEBOOTSTRAP_IMAGE=tandem-base:bookworm
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

usage() {
    cat <<EOF
Usage: deploy/image/build.sh [--gpu | --cpu] [--base IMAGE | --debootstrap] [--wheels DIR]
                             [--pip-cert FILE] [--tag TAG] [--dry-run] [-- BUILD_OPTION...]

Builds the repository's Dockerfile with podman or docker, in docker format: the OCI
format has no HEALTHCHECK, and podman would drop it.

  --gpu            the default: CUDA torch wheels from the Dockerfile's TORCH_INDEX_URL on
                   its nvidia/cuda runtime base
  --cpu            torch's CPU wheel (torch==VERSION+cpu from $CPU_TORCH_INDEX)
                   on debian:bookworm-slim: no CUDA libraries, no Triton, no compiler
  --base IMAGE     the base image (build arg BASE_IMAGE, also read from \$BASE_IMAGE); it
                   needs apt-get, and gets Python 3 from apt unless it has its own
  --debootstrap    base on $DEBOOTSTRAP_IMAGE, made here with debootstrap when no such
                   image exists (a minimal bookworm without docs, manuals or locales): for
                   hosts that reach a Debian mirror but no image registry; needs root.
                   Mirrors: \$DEBIAN_MIRROR (http://deb.debian.org/debian),
                   \$DEBIAN_SECURITY_MIRROR (http://deb.debian.org/debian-security)
  --wheels DIR     a directory with the torch wheel, served to the build on 127.0.0.1
                   (so the build runs on the host's network) and searched before the
                   index, which becomes \$TORCH_INDEX_URL or PyPI. Without it, --cpu takes
                   \$PIP_FIND_LINKS or pip's configured find-links directories when
                   download.pytorch.org cannot be reached.
  --pip-cert FILE  a CA bundle for pip in the build (behind a TLS-inspecting proxy), as the
                   build secret pip_cert: never stored in the image. Default: \$PIP_CERT,
                   else pip's configured global.cert, else none.
  --tag TAG        default tandem:VERSION, or tandem:VERSION-cpu with --cpu
  --dry-run        print the commands instead of running them (with --debootstrap,
                   the base's making too, whether or not the base exists)
  -h, --help       this text
  --               the rest goes to the engine's build command as it is

More environment: TORCH_VERSION (default: the Dockerfile's; --cpu appends +cpu),
TORCH_INDEX_URL (default: the Dockerfile's; --cpu: the CPU index),
IMAGE_BUILD_NETWORK (the build's --network; default: host with --wheels, else the
engine's own).

$ENGINE_ENV_HELP

Examples:
  deploy/image/build.sh                                            # GPU
  deploy/image/build.sh --cpu                                      # CPU, from the registries
  deploy/image/build.sh --cpu --debootstrap --wheels /opt/wheels   # no image registry
EOF
}

variant=gpu base=${BASE_IMAGE:-} debootstrap=0 wheels="" tag="" dry_run=0
pip_cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
extra=()
while (($#)); do
    case $1 in
    -h | --help) usage; exit 0 ;;
    --cpu) variant=cpu ;;
    --gpu) variant=gpu ;;
    --base) base=${2:?--base needs an image}; shift ;;
    --debootstrap) debootstrap=1 ;;
    --wheels) wheels=${2:?--wheels needs a directory}; shift ;;
    --pip-cert) pip_cert=${2:?--pip-cert needs a file}; shift ;;
    --tag) tag=${2:?--tag needs a name}; shift ;;
    --dry-run) dry_run=1 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ $debootstrap == 1 && -n $base ]] && die "--base and --debootstrap exclude each other"
[[ -z $wheels || -d $wheels ]] || die "--wheels: no directory $wheels"
[[ -z $pip_cert || -f $pip_cert ]] || die "--pip-cert: no file $pip_cert"

rootfs="" server=""
cleanup() {
    [[ -n $server ]] && kill "$server" 2>/dev/null
    [[ -n $rootfs ]] && rm -rf "$rootfs"
    return 0
}
trap cleanup EXIT

run() {
    if ((dry_run)); then
        printf '%q ' "$@"
        echo
    else
        "$@"
    fi
}

engine_init

version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -n1)
dockerfile_torch=$(sed -n 's/^ARG TORCH_VERSION=//p' "$ROOT/Dockerfile")
torch_version=${TORCH_VERSION:-$dockerfile_torch}
index=${TORCH_INDEX_URL:-}
if [[ $variant == cpu ]]; then
    tag=${tag:-tandem:$version-cpu}
    [[ $torch_version == *+* ]] || torch_version+="+cpu"
    index=${index:-$CPU_TORCH_INDEX}
    base=${base:-debian:bookworm-slim}
else
    tag=${tag:-tandem:$version}
fi

# pip's own configuration may point at local wheels (find-links) that a container cannot
# see: serve them when the CPU index is out of reach.
if [[ $variant == cpu && -z $wheels && $index == "$CPU_TORCH_INDEX" ]] &&
    ! curl -fsS --max-time 10 -o /dev/null "$CPU_TORCH_INDEX/torch/" 2>/dev/null; then
    for dir in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
        dir=${dir#file://}
        if compgen -G "$dir/torch-${torch_version}-*.whl" >/dev/null; then
            wheels=$dir
            echo "build.sh: $CPU_TORCH_INDEX unreachable; torch from $dir (pip's find-links)" >&2
            break
        fi
    done
fi

if ((debootstrap)); then
    base=$DEBOOTSTRAP_IMAGE
    if ((dry_run)) || ! "${ENGINE_CMD[@]}" image inspect "$base" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || ((dry_run)) ||
            die "--debootstrap needs debootstrap (apt-get install debootstrap)"
        rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/tandem-base.XXXXXX")
        mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
        run debootstrap --variant=minbase bookworm "$rootfs" "$mirror"
        # What Docker's debian:*-slim images do: dpkg leaves docs, manuals and locales out
        # of every later install too, and apt keeps no package lists or .debs behind.
        slim_dpkg='path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias'
        slim_apt='DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";'
        sources="deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main"
        if ((dry_run)); then
            echo "# then: slim $rootfs (no docs, manuals, locales, apt lists or caches)"
        else
            printf '%s\n' "$slim_dpkg" >"$rootfs/etc/dpkg/dpkg.cfg.d/slim"
            printf '%s\n' "$slim_apt" >"$rootfs/etc/apt/apt.conf.d/slim"
            printf '%s\n' "$sources" >"$rootfs/etc/apt/sources.list"
            find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
            find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
            rm -rf "$rootfs"/usr/share/{man,info}/* "$rootfs"/var/lib/apt/lists/* \
                "$rootfs"/var/cache/apt/* "$rootfs"/var/log/*.log
            find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias \
                -exec rm -rf {} +
        fi
        if ((dry_run)); then
            echo "tar -C $rootfs -c . | ${ENGINE_CMD[*]} import --change 'CMD [\"/bin/bash\"]' - $base"
        else
            tar -C "$rootfs" -c . |
                "${ENGINE_CMD[@]}" import --change 'CMD ["/bin/bash"]' - "$base"
        fi
    fi
fi

build=("${ENGINE_CMD[@]}" build)
[[ $ENGINE == podman ]] && build+=(--format docker)
build+=("${RUN_OPTS[@]}" --tag "$tag" --file "$ROOT/Dockerfile")
[[ -n $base ]] && build+=(--build-arg "BASE_IMAGE=$base")
[[ $torch_version != "$dockerfile_torch" ]] && build+=(--build-arg "TORCH_VERSION=$torch_version")

network=${IMAGE_BUILD_NETWORK:-}
if [[ -n $wheels ]]; then
    # The build reaches the host's 127.0.0.1 only on the host's network.
    network=${network:-host}
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    index=${TORCH_INDEX_URL:-https://pypi.org/simple}
    build+=(--build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$port/")
    if ((!dry_run)); then
        python3 -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" \
            >/dev/null 2>&1 &
        server=$!
        for _ in $(seq 50); do
            curl -fsS -o /dev/null "http://127.0.0.1:$port/" 2>/dev/null && break
            sleep 0.1
        done
    else
        echo "# serving $wheels on http://127.0.0.1:$port/ during the build"
    fi
fi
[[ -n $index ]] && build+=(--build-arg "TORCH_INDEX_URL=$index")
[[ -n $network ]] && build+=(--network "$network")
[[ -n $pip_cert ]] && build+=(--secret "id=pip_cert,src=$pip_cert")
build+=("${extra[@]}" "$ROOT")

start=$SECONDS
run "${build[@]}"
((dry_run)) && exit 0
echo "built $tag in $((SECONDS - start)) s with $ENGINE:" \
    "$("${ENGINE_CMD[@]}" image inspect --format '{{.Size}}' "$tag" |
        awk '{printf "%.0f MB (%.2f GiB)", $1 / 1e6, $1 / 2^30}')"
