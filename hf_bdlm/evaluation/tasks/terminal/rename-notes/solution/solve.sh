#!/usr/bin/env bash
# Reference solution (Harbor oracle); the working directory is the task folder /app.
set -euo pipefail
cd "${APP_DIR:-/app}"
for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done
