#!/usr/bin/env bash
# Reference solution (Harbor oracle); the working directory is the task folder /app.
set -euo pipefail
cd "${APP_DIR:-/app}"
printf 'Hello, terminal!\n' > greeting.txt
