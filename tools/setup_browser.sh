#!/usr/bin/env bash
# Installs Debian's Chromium (and a font) from the system's packages, for
# tests/test_docs.py: the documentation site opened in a headless browser.
# Unattended, as root (CI) or with passwordless sudo; elsewhere it says why not
# and exits 0: the browser test then skips with that reason (the site's strict
# build still runs). Nothing is started here.
set -uo pipefail
source "$(dirname "$0")/apt_install.sh"

if [ -x /usr/bin/chromium ]; then
  echo "setup_browser: Chromium is installed."
  exit 0
fi
apt_install setup_browser /tmp/setup_browser.log "the browser test skips." chromium fonts-dejavu-core
