#!/usr/bin/env bash
# Installs Debian's Chromium (and a font) from the system's packages, for
# tests/test_docs.py: the documentation site opened in a headless browser.
#
# Unattended: Debian/Ubuntu with apt-get, as root (CI), else a message saying
# why not, and exit 0: the browser test then skips with that reason (the
# site's strict build still runs). Nothing is started here.
set -uo pipefail

if [ -x /usr/bin/chromium ]; then
  echo "setup_browser: Chromium is installed."
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_browser: no /usr/bin/chromium and no apt-get here: install Chromium with the" \
       "system's package manager; the browser test skips." >&2
  exit 0
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    echo "setup_browser: no /usr/bin/chromium; installing it needs root (or sudo without a" \
         "password). Run: apt-get install chromium fonts-dejavu-core. The browser test skips." >&2
    exit 0
  fi
fi
packages=(chromium fonts-dejavu-core)
echo "setup_browser: installing ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get install -y -q --no-install-recommends "${packages[@]}" >/tmp/setup_browser.log 2>&1; then
  "${sudo[@]}" apt-get update -q >>/tmp/setup_browser.log 2>&1
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "${packages[@]}" >>/tmp/setup_browser.log 2>&1
fi
code=$?
if [ "$code" != 0 ]; then
  echo "setup_browser: apt-get failed (exit $code; see /tmp/setup_browser.log); the browser test skips." >&2
  tail -5 /tmp/setup_browser.log >&2
fi
exit 0
