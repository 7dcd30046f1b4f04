package cloudinit

import (
	"fmt"
	"path"
	"strings"
)

// Layout places the agents' files on a host: the standard paths, or all of
// them under Prefix (a test install, or a host without a writable /usr).
type Layout struct{ Prefix string }

func (l Layout) at(p string) string {
	if l.Prefix == "" {
		return p
	}
	return path.Join(l.Prefix, p)
}

// ShimBin is where dstack-shim is installed.
func (l Layout) ShimBin() string { return l.at(shimBin) }

// RunnerBin is where dstack-runner is installed.
func (l Layout) RunnerBin() string { return l.at(runnerBin) }

// EnvFile is the shim's EnvironmentFile.
func (l Layout) EnvFile() string { return l.at(envFile) }

// UnitFile is the systemd unit (installed only under the empty prefix:
// systemd reads /etc/systemd/system).
func (l Layout) UnitFile() string { return l.at(unitFile) }

// Supervisor is the fallback supervisor script for hosts where systemd is
// not PID 1 (containers, WSL, some VPS images).
func (l Layout) Supervisor() string { return l.at("/usr/local/lib/tandem/supervise-shim.sh") }

// RunDir holds the supervisor's pid files and the shim's log.
func (l Layout) RunDir() string { return l.at("/var/lib/tandem") }

// DefaultShimHome is the shim home for this layout.
func (l Layout) DefaultShimHome() string { return l.at("/root/.dstack") }

// Validate refuses prefixes that the rendered scripts could not quote.
func (l Layout) Validate() error {
	if l.Prefix != "" && (!strings.HasPrefix(l.Prefix, "/") || strings.ContainsAny(l.Prefix, "'\"\\ \n\t$`;&|<>*?()") || path.Clean(l.Prefix) != l.Prefix) {
		return fmt.Errorf("prefix %q: want a clean absolute path without spaces or shell characters", l.Prefix)
	}
	return nil
}

// HostFiles are the files an install over SSH writes: the same env file
// and unit `tandem cloudinit` renders, and the fallback supervisor.
type HostFiles struct {
	Env, Unit, Supervisor string
}

// Host renders v's files for layout l.
func (v VM) Host(l Layout) (HostFiles, error) {
	if err := l.Validate(); err != nil {
		return HostFiles{}, err
	}
	v.Baked = true // the binaries are uploaded, never downloaded
	if v.ShimHome == "" {
		v.ShimHome = l.DefaultShimHome()
	}
	v.defaults()
	if err := v.Validate(); err != nil {
		return HostFiles{}, err
	}
	return HostFiles{Env: v.envLinesFor(l), Unit: unitFor(l), Supervisor: supervisorFor(l)}, nil
}

// supervisorFor restarts the shim whenever it exits, as systemd's
// Restart=always would; the shim's pid is kept for upgrades (kill it and
// the new binary starts) and uninstalls (kill the supervisor, then it).
func supervisorFor(l Layout) string {
	return `#!/bin/sh
# Tandem: supervise dstack-shim where systemd is not PID 1 (written by tandem host install).
run=` + l.RunDir() + `
echo $$ > "$run/supervisor.pid"
trap 'kill "$(cat "$run/shim.pid" 2>/dev/null)" 2>/dev/null; rm -f "$run/supervisor.pid" "$run/shim.pid"; exit 0' TERM INT
while :; do
	set -a
	. ` + l.EnvFile() + `
	set +a
	# one old log kept, rotated at 64 MiB when the shim (re)starts
	[ "$(wc -c <"$run/shim.log" 2>/dev/null || echo 0)" -gt 67108864 ] && mv -f "$run/shim.log" "$run/shim.log.1"
	` + l.ShimBin() + ` >>"$run/shim.log" 2>&1 </dev/null &
	echo $! > "$run/shim.pid"
	wait $!
	sleep 3
done
`
}
