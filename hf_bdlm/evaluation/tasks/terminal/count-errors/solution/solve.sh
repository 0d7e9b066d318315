#!/usr/bin/env bash
# Reference solution (Harbor oracle); the working directory is the task folder /app.
set -euo pipefail
cd "${APP_DIR:-/app}"
grep -c ERROR server.log > error_count.txt
