// Package cloudinit renders how Tandem's agents reach a machine: cloud-init
// user-data and a startup script that install and supervise dstack-shim on
// a VM, and a container entrypoint that starts dstack-runner in any image.
package cloudinit

import (
	"bytes"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"text/template"

	"golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/api"
)

// Entrypoint is a container entrypoint override for container-only clouds
// (Kubernetes, RunPod, Vast.ai): fetch the static runner, check it, exec it.
type Entrypoint struct {
	RunnerURL      string   // required: http(s) URL of the static dstack-runner
	RunnerSHA256   string   // hex; recommended
	AuthorizedKeys []string // required: keys of the server/user
	HTTPPort       int      // default 10999
	SSHPort        int      // default 10022
	LogLevel       string   // default "4" (info)
	Path           string   // where the runner is put, default /usr/local/bin/dstack-runner
}

var hexSHA = regexp.MustCompile(`^[0-9a-f]{64}$`)

// validURL requires an absolute http(s) URL with a host.
func validURL(field, raw string) error {
	if raw == "" {
		return fmt.Errorf("%s: required", field)
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%s: %q is not an http(s) URL", field, raw)
	}
	// Every use in a script is quoted, and values reach commands only as
	// arguments, never as code; still, characters a shell would act on are
	// refused here too (& ? = % stay: presigned URLs need them).
	for _, c := range raw {
		if c < 0x21 || c > 0x7e || strings.ContainsRune("'\"\\$`;|<>(){}!*[]^", c) {
			return fmt.Errorf("%s: %q has a character (%q) that cannot be used safely in a script", field, raw, c)
		}
	}
	return nil
}

func validKeys(field string, keys []string) error {
	for i, k := range keys {
		if _, _, _, _, err := ssh.ParseAuthorizedKey([]byte(k)); err != nil {
			return fmt.Errorf("%s[%d]: not an SSH public key: %v", field, i, err)
		}
		if strings.ContainsAny(k, "'\n") {
			return fmt.Errorf("%s[%d]: contains a quote or newline", field, i)
		}
	}
	return nil
}

func (e *Entrypoint) defaults() {
	if e.HTTPPort == 0 {
		e.HTTPPort = api.RunnerHTTPPort
	}
	if e.SSHPort == 0 {
		e.SSHPort = api.RunnerSSHPort
	}
	if e.LogLevel == "" {
		e.LogLevel = "4"
	}
	if e.Path == "" {
		e.Path = "/usr/local/bin/dstack-runner"
	}
}

// Validate reports the first bad field by name.
func (e Entrypoint) Validate() error {
	e.defaults()
	if err := validURL("runner_url", e.RunnerURL); err != nil {
		return err
	}
	if e.RunnerSHA256 != "" && !hexSHA.MatchString(e.RunnerSHA256) {
		return fmt.Errorf("runner_sha256: %q is not a hex SHA-256", e.RunnerSHA256)
	}
	if len(e.AuthorizedKeys) == 0 {
		return fmt.Errorf("authorized_keys: at least one key is required")
	}
	if err := validKeys("authorized_keys", e.AuthorizedKeys); err != nil {
		return err
	}
	for name, p := range map[string]int{"http_port": e.HTTPPort, "ssh_port": e.SSHPort} {
		if p < 1 || p > 65535 {
			return fmt.Errorf("%s: %d is not a port", name, p)
		}
	}
	if !regexp.MustCompile(`^[a-zA-Z1-6]+$`).MatchString(e.LogLevel) {
		return fmt.Errorf("log_level: %q", e.LogLevel)
	}
	if !strings.HasPrefix(e.Path, "/") || strings.ContainsAny(e.Path, "'\"\\ \n$`") {
		return fmt.Errorf("path: %q must be an absolute path without quotes or spaces", e.Path)
	}
	return nil
}

// The script: POSIX sh, no package installs, no sshd. Each way to fetch is
// tried in turn and a failing one falls through to the next: curl, wget,
// then for plain http a raw request through bash's /dev/tcp or nc (busybox
// has it), whose header is cut binary-safely. Bounded retries; checksum
// before exec.
var entrypointTmpl = template.Must(template.New("ep").Parse(`set -e
U='{{.RunnerURL}}';B='{{.Path}}';S='{{.RunnerSHA256}}'
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
exec "$B" --log-level {{.LogLevel}} start --http-port {{.HTTPPort}} --ssh-port {{.SSHPort}}{{range .AuthorizedKeys}} --ssh-authorized-key '{{.}}'{{end}}
`))

// Render returns the entrypoint script.
func (e Entrypoint) Render() (string, error) {
	e.defaults()
	if err := e.Validate(); err != nil {
		return "", err
	}
	var b bytes.Buffer
	if err := entrypointTmpl.Execute(&b, e); err != nil {
		return "", err
	}
	return "#!/bin/sh\n" + b.String(), nil
}

// Command returns the entrypoint as a container command: ["/bin/sh", "-c", script].
func (e Entrypoint) Command() ([]string, error) {
	s, err := e.Render()
	if err != nil {
		return nil, err
	}
	return []string{"/bin/sh", "-c", s}, nil
}
