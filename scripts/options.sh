# Sourced by the scripts in this directory (not run on its own): the one way they print their --help and check a
# number they are given.

# Prints a script's header: its comment lines from line 2 up to its first line of code, without the "# ".
print_help() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$1"; }

# True when $1 is a whole number ≥ $2, written without leading zeros (bash would read 08 as a bad octal number)
# and with at most 9 digits.
whole_at_least() { [[ "$1" =~ ^(0|[1-9][0-9]{0,8})$ ]] && (( $1 >= $2 )); }

# need_whole VALUE MIN LINE: unless VALUE is a whole number ≥ MIN, prints LINE on stderr and exits 2.
need_whole() { whole_at_least "$1" "$2" || { echo "$3" >&2; exit 2; }; }
