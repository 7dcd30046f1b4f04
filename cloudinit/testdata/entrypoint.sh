#!/bin/sh
set -e
U='https://example.com/tandem/0.1.0/dstack-runner-linux-amd64';B='/usr/local/bin/dstack-runner';S='abababababababababababababababababababababababababababababababab'
f(){ echo "tandem: $*" >&2; exit 1; }
g(){
command -v curl >/dev/null&&curl -fsSL --connect-timeout 10 -m 300 -o "$B" "$U"&&return
command -v wget >/dev/null&&wget -q -T 30 -O "$B" "$U" 2>/dev/null&&return
[ "${U%%://*}" = http ]||return 1
h=${U#http://};p=/${h#*/};h=${h%%/*};o=${h#*:};[ "$o" = "$h" ]&&o=80;h=${h%:*}
if [ -x /bin/bash ];then /bin/bash -c 'exec 3<>"/dev/tcp/$1/$2"&&printf "GET %s HTTP/1.0\r\nHost: %s\r\n\r\n" "$3" "$1">&3&&cat<&3' _ "$h" "$o" "$p">"$B.t"||return 1
elif command -v nc >/dev/null;then printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$p" "$h"|nc "$h" "$o">"$B.t"||return 1
else return 1;fi
head -n1 "$B.t"|grep -q ' 200'||return 1
n=0;while IFS= read -r l;do n=$((n+${#l}+1));[ "$l" = "$(printf '\r')" ]&&break;done<"$B.t"
tail -c +$((n+1)) "$B.t">"$B";rm -f "$B.t";}
mkdir -p "${B%/*}";n=0
until g;do n=$((n+1));[ $n -ge 5 ]&&f "cannot download $U";sleep 2;done
if [ -n "$S" ];then
command -v sha256sum >/dev/null||f "no sha256sum to verify the runner"
echo "$S  $B"|sha256sum -c - >/dev/null 2>&1||f "checksum mismatch for $U";fi
chmod 755 "$B"
exec "$B" --log-level 4 start --http-port 10999 --ssh-port 10022 --ssh-authorized-key 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop' --ssh-authorized-key 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop'
