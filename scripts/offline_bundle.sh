#!/usr/bin/env bash
# MiniWoB++'s host programs for a Linux x86-64 host without network (an air-gapped GPU node, say): Debian's chromium
# (its binary, resources and wrapper with /etc/chromium.d), chromium-driver, socat, bubblewrap, the DejaVu fonts
# (regular and bold sans, serif and mono) with /etc/fonts, and every shared library they load that is not glibc's,
# packed on a Debian host that has them (scripts/setup.sh installs them) and installed on the other.
#
#     bash scripts/offline_bundle.sh pack OUTDIR [PART_MB]   -> OUTDIR/bundle.tar.xz.part00, part01, ... (default 48 MB)
#     bash scripts/offline_bundle.sh install DIR             (as root, on the target: DIR holds all the parts)
#     bash scripts/offline_bundle.sh libs                    (the libraries pack would bundle, a path a line)
#
# install unpacks into / without replacing a directory's attributes, puts the libraries in /usr/lib/tars-offline,
# and lists that directory last for the dynamic linker (/etc/ld.so.conf.d/zz-tars-offline.conf), so a library the
# host has is taken from the host and only the missing ones from the bundle. Everything lands under /usr and /etc,
# which envd's sandboxes bind read-only (envd/bwrap.py, envd/miniwob_chromium.py). The target's glibc must be at
# least the packing host's (Debian 12: 2.36).
set -eu
usage="usage: offline_bundle.sh pack OUTDIR [PART_MB] | install DIR | libs"
verb=${1:?$usage}
[[ $verb == libs ]] || dir=${2:?$usage}
LIBDIR=/usr/lib/tars-offline
# The programs whose libraries travel (pack) and must all resolve on the target (install).
programs() {
  local f
  for f in /usr/lib/chromium/chromium /usr/lib/chromium/chrome_crashpad_handler /usr/lib/chromium/*.so \
           /usr/lib/chromium/libvulkan.so.1 /usr/bin/chromedriver /usr/bin/bwrap /usr/bin/socat; do
    [[ -e $f ]] && echo "$f"
  done
  return 0
}

# The shared libraries the programs load that are not glibc's, one path a line; exit 1 naming a program that ldd
# cannot read.
bundle_libs() {
  local libs=() f lib own
  for f in $(programs); do
    ldd "$f" >/dev/null 2>&1 || { echo "ldd cannot read $f" >&2; exit 1; }
    mapfile -t -O "${#libs[@]}" libs < <(ldd "$f" | awk '/=> \//{print $3}')
  done
  for lib in $(printf '%s\n' "${libs[@]}" | sort -u); do
    own=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true)
    [[ ${own%%:*} == libc6 ]] || echo "$lib"     # glibc's own are the target's
  done
}

pack() {
  local part_mb=${1:-48} n=0
  root=$(mktemp -d)                                 # global: the EXIT trap reads it after pack returns
  trap 'rm -rf "$root"' EXIT
  mkdir -p "$root/usr/lib/chromium/locales" "$root/usr/bin" "$root/etc" "$root$LIBDIR" "$root/usr/share/fonts"
  # the browser without its Vulkan validation layer and mock driver (test tools, 24 MB) and with one locale
  for f in /usr/lib/chromium/*; do
    case ${f##*/} in libVkLayer_*|libVkICD_mock_*|*.TOC|locales|chrome_200_percent.pak) continue ;; esac
    cp -a "$f" "$root/usr/lib/chromium/"
  done
  cp -a /usr/lib/chromium/locales/en-US.pak "$root/usr/lib/chromium/locales/"
  cp -a /usr/bin/chromium /usr/bin/chromedriver /usr/bin/bwrap /usr/bin/socat "$root/usr/bin/"
  cp -a /etc/chromium /etc/chromium.d /etc/fonts "$root/etc/"
  mkdir -p "$root/usr/share/fonts/truetype/dejavu"   # what fontconfig picks for sans-serif, serif and monospace
  cp -a /usr/share/fonts/truetype/dejavu/DejaVu{Sans,Serif,SansMono}{,-Bold}.ttf \
        "$root/usr/share/fonts/truetype/dejavu/"
  local libs lib
  libs=$(bundle_libs)                               # a failure here ends pack (set -e), unlike in a for list
  for lib in $libs; do cp -L "$lib" "$root$LIBDIR/"; done
  n=$(ls "$root$LIBDIR" | wc -l)
  mkdir -p "$dir"
  rm -f "$dir"/bundle.tar.xz.part*
  tar -C "$root" -cf - . | xz -T0 --x86 --lzma2=preset=9 | split -b "${part_mb}M" -d - "$dir/bundle.tar.xz.part"
  echo "packed $(du -sh "$root" | cut -f1) ($n libraries) into" \
       "$(du -ch "$dir"/bundle.tar.xz.part* | tail -n 1 | cut -f1) in $(ls "$dir"/bundle.tar.xz.part* | wc -l) parts" \
       "under $dir"
}

install_bundle() {
  cat "$dir"/bundle.tar.xz.part* | xz -d | tar -C / -x --no-overwrite-dir --keep-directory-symlink
  echo "$LIBDIR" >/etc/ld.so.conf.d/zz-tars-offline.conf
  ldconfig
  local missing
  missing=$(for f in $(programs); do ldd "$f" | grep 'not found' || true; done)
  [[ -z $missing ]] || { echo "libraries still missing: $missing" >&2; exit 1; }
  echo "installed: $(chromium --version 2>&1 | head -n 1), chromedriver $(chromedriver --version | cut -d' ' -f2)," \
       "$(bwrap --version), $(socat -V 2>/dev/null | grep -m1 'socat version' | cut -d' ' -f1-3)"
}

case $verb in
  pack) pack "${3:-48}" ;;
  install) install_bundle ;;
  libs) bundle_libs ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
