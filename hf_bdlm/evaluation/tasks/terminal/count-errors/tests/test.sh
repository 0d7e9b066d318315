#!/usr/bin/env bash
# Verifier (Harbor task format): writes 1 (solved) or 0 to $LOGS_DIR/verifier/reward.txt.
# APP_DIR and LOGS_DIR default to the container paths; the local runner of hf-bdlm points them at its sandbox.
APP="${APP_DIR:-/app}"
LOGS="${LOGS_DIR:-/logs}"
mkdir -p "$LOGS/verifier"
check() {
  [ "$(tr -d "[:space:]" < "$APP/error_count.txt" 2>/dev/null)" = "3" ]
}
if check; then echo 1 > "$LOGS/verifier/reward.txt"; else echo 0 > "$LOGS/verifier/reward.txt"; fi
