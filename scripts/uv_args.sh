# Sourced by the scripts that run uv (setup_env.sh, install_sglang_cpu.sh, lock_constraints.sh, check_installs.py
# reads the same setting itself): uv reads no pip configuration, so pip's find-links, where these machines keep the
# CPU build of torch 2.13.0, is handed to it. Sets UV_FIND_LINKS_ARGS (an array, maybe empty).
pip_find_links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
UV_FIND_LINKS_ARGS=()
for location in $pip_find_links; do UV_FIND_LINKS_ARGS+=(--find-links "$location"); done
unset pip_find_links location
