#!/usr/bin/env bash
# Open WebUI, as its users install it (pip install open-webui), pointed at `localllm serve` through its Ollama
# connection: it lists the server's models, a chat completes (streamed and not), and its model management works
# (pull, copy, delete, through its /ollama/api/* routes). Not in `make test-clients`: Open WebUI and what it pulls
# in (PyTorch among it) are 7.4 GB in its venv, 10 minutes of install. Run from the repository root after `make test-models`:
#     bash tools/check_open_webui.sh [VENV_DIR]      (default /tmp/open-webui-venv; reused when there)
set -euo pipefail
VENV=${1:-/tmp/open-webui-venv}
WORK=$(mktemp -d)
LOCALLLM=.venv/bin/localllm
[ -x "$VENV/bin/open-webui" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install --quiet open-webui; }
echo "open-webui $("$VENV/bin/pip" show open-webui | sed -n 's/^Version: //p')"
$LOCALLLM serve --port 18431 --ctx 4096 > "$WORK/localllm.log" 2>&1 & SERVER=$!
(cd "$WORK" && DATA_DIR="$WORK/data" OLLAMA_BASE_URL=http://127.0.0.1:18431 WEBUI_AUTH=False ENABLE_OPENAI_API=False \
  OFFLINE_MODE=true HF_HUB_OFFLINE=1 ENABLE_VERSION_UPDATE_CHECK=false ANONYMIZED_TELEMETRY=false \
  "$VENV/bin/open-webui" serve --host 127.0.0.1 --port 18432 > "$WORK/open-webui.log" 2>&1) & UI=$!
trap 'kill $UI $SERVER 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 180); do curl -sf localhost:18432/health >/dev/null && break; sleep 1; done
U=http://127.0.0.1:18432
TOKEN=$(curl -sf -X POST $U/api/v1/auths/signin -H 'Content-Type: application/json' -d '{"email":"","password":""}' \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
H="Authorization: Bearer $TOKEN"
J='Content-Type: application/json'
names() { curl -sf "$U/ollama/api/tags" -H "$H" | python3 -c 'import json,sys; print(" ".join(sorted(m["name"] for m in json.load(sys.stdin)["models"])))'; }
models=$(curl -sf $U/api/models -H "$H" | python3 -c 'import json,sys; print(" ".join(m["id"] for m in json.load(sys.stdin)["data"]))')
echo "models: $models"; [[ " $models " == *" smollm2-135m-instruct "* ]]
answer=$(curl -sf $U/api/chat/completions -H "$H" -H "$J" -d '{"model":"smollm2-135m-instruct","stream":false,
  "messages":[{"role":"user","content":"Name one primary colour."}]}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')
echo "chat: $answer"; [ -n "$answer" ]
chunks=$(curl -sfN $U/api/chat/completions -H "$H" -H "$J" -d '{"model":"smollm2-135m-instruct","stream":true,
  "messages":[{"role":"user","content":"Say hi."}]}' | grep -c '^data: {')
echo "streamed chunks: $chunks"; [ "$chunks" -gt 1 ]
curl -sfN -X POST $U/ollama/api/pull/0 -H "$H" -H "$J" -d '{"model":"smollm2-135m-instruct"}' | tail -1 | grep -q '"success"'
echo "pull: success"
[ "$(curl -sf -X POST $U/ollama/api/copy/0 -H "$H" -H "$J" -d '{"source":"smollm2-135m-instruct","destination":"webui-scratch"}')" = true ]
sleep 2; [[ " $(names) " == *" webui-scratch "* ]]; echo "copy: webui-scratch listed"
[ "$(curl -sf -X DELETE $U/ollama/api/delete/0 -H "$H" -H "$J" -d '{"model":"webui-scratch"}')" = true ]
for _ in $(seq 30); do [[ " $(names) " != *" webui-scratch "* ]] && break; sleep 1; done  # its model list is cached
[[ " $(names) " != *" webui-scratch "* ]]; echo "delete: webui-scratch gone"
! grep -q Traceback "$WORK/localllm.log"
echo "Open WebUI against localllm serve: all checks passed"
