#!/usr/bin/env bash
# Reference solution (Harbor oracle); the working directory is the task folder /app.
set -euo pipefail
cd "${APP_DIR:-/app}"
python3 -c "import json; print(json.load(open('config.json'))['server']['port'])" > port.txt
