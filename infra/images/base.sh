#!/usr/bin/env bash
# Make sure the Dockerfile's base image exists locally: use it if present, else pull it, and where no registry can
# be reached build an equivalent one (Debian bookworm, its Python 3.11 with venv, `python` on the PATH, CA
# certificates) with debootstrap from the machine's Debian mirror, and tag it with the name FROM expects.
#   infra/images/base.sh IMAGE
# The debootstrapped root filesystem is cached as a tarball (CLOOB_IMAGE_CACHE, default
# /var/cache/cloob-pipelines), so a second machine run imports it in seconds instead of ~60 s.
set -euo pipefail
image=${1:?usage: $0 IMAGE}
docker_cli=${DOCKER:-$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || echo docker )}
cache=${CLOOB_IMAGE_CACHE:-/var/cache/cloob-pipelines}
rootfs_tar=$cache/debian-bookworm-python3.tar

if "$docker_cli" image inspect "$image" >/dev/null 2>&1; then
  echo "base: $image is present"
  exit 0
fi
if timeout 60 "$docker_cli" pull -q "$image" >/dev/null 2>&1; then
  echo "base: pulled $image"
  exit 0
fi
echo "base: $image cannot be pulled; building an equivalent from Debian bookworm"
if [ ! -s "$rootfs_tar" ]; then
  command -v debootstrap >/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  }
  mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv,python-is-python3 \
    bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { echo "base: debootstrap failed; the end of its log:" >&2; tail -5 "$work/debootstrap.log" >&2; exit 1; }
  # A machine behind a TLS-inspecting proxy has extra CAs; without them pip inside the build cannot verify PyPI.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$work/rootfs/usr/local/share/ca-certificates/"
    chroot "$work/rootfs" update-ca-certificates >/dev/null 2>&1 \
      || { echo "base: update-ca-certificates failed in the new root" >&2; exit 1; }
  fi
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
  mkdir -p "$cache"
  tar -C "$work/rootfs" -cf "$rootfs_tar.part" . && mv "$rootfs_tar.part" "$rootfs_tar"
fi
"$docker_cli" import "$rootfs_tar" "$image" >/dev/null
echo "base: imported $image from $rootfs_tar ($(du -h "$rootfs_tar" | cut -f1))"
