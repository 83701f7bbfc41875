# Sourced first by every script in scripts/. Under `set -Eeuo pipefail` a command that fails ends the
# script; the ERR trap first names the script, the line and the command, so that no setup step ends
# silently. (-E: the trap holds inside functions too; it speaks only in the script's own shell, not in
# a command substitution or subshell, whose failure the outer line reports once.)
set -Eeuo pipefail
trap 'rc_=$?; [ "$BASH_SUBSHELL" != 0 ] || printf "%s: line %s: \`%s\` failed (exit status %s)\n" \
    "${BASH_SOURCE[0]:-$0}" "$LINENO" "$BASH_COMMAND" "$rc_" >&2' ERR
