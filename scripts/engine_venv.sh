# Sourced by the engines' set-up scripts: the venv opening they share.
# `engine_venv VENV STAMP WANT` returns 1 when the STAMP file already says WANT (nothing to do);
# otherwise it creates VENV if missing, installs torch and torchvision (the pair that loads on a
# machine without a GPU: scripts/setup_env.sh says why) and packaging, and sets PIP for the caller.
# The caller writes WANT to STAMP once its venv imports.
PYTHON=${PYTHON:-python3}

engine_venv() {
  local venv=$1 stamp=$2 want=$3
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 1
  fi
  if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv"
  fi
  PIP=("$venv/bin/python" -m pip install -q)
  "${PIP[@]}" --upgrade pip >/dev/null
  # The `!=` keeps the local CPU-only wheel of the same version out.
  "${PIP[@]}" "torch==2.13.0,!=2.13.0+cpu" "torchvision==0.28.0" packaging
}
