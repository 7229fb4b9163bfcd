# Sourced by the engines' set-up scripts: the venv opening they share.
#   engine_venv_current STAMP WANT   succeeds when the STAMP file already says WANT (nothing to do)
#   engine_venv VENV                 creates VENV if missing, installs torch and torchvision (the pair that
#                                    loads on a machine without a GPU: scripts/setup_env.sh says why) and
#                                    packaging, and sets PIP for the caller. The torch family is first
#                                    hard-linked from .venv where .venv has it (scripts/link_torch_family.py),
#                                    so the venvs hold one copy of its 4.6 GB on disk
# engine_venv must be called as a plain command, never in an `if`, `&&` or `||` list: there bash ignores
# `set -e` inside the function, and a failed install would go unnoticed.
#   engine_venv_done VENV STAMP WANT IMPORTS
#                                    checks that IMPORTS (a Python import line) run in VENV, showing the
#                                    error and failing if not, then writes WANT to STAMP
PYTHON=${PYTHON:-python3}

engine_venv_current() {
  [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]
}

engine_venv() {
  if [ ! -x "$1/bin/python" ]; then
    "$PYTHON" -m venv "$1"
  fi
  if [ -x .venv/bin/python ]; then
    .venv/bin/python scripts/link_torch_family.py \
      "$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  fi
  PIP=("$1/bin/python" -m pip install -q)
  "${PIP[@]}" --upgrade pip >/dev/null
  # The `!=` keeps the local CPU-only wheel of the same version out.
  "${PIP[@]}" "torch==2.13.0,!=2.13.0+cpu" "torchvision==0.28.0" packaging
}

engine_venv_done() {
  if ! HF_HUB_OFFLINE=1 "$1/bin/python" -c "$4" >/dev/null 2>&1; then
    echo "$(basename "$0"): '$4' fails in $1" >&2
    HF_HUB_OFFLINE=1 "$1/bin/python" -c "$4"
    return 1
  fi
  echo "$3" > "$2"
}
