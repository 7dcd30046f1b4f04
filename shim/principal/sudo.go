package principal

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/tandem-run/tandem/common/toolrun"
)

// The question put to sudo: may this account run a shell as root? A user
// who may is root. sudo answers it exactly as it would decide the command
// itself: its host and runas matching, the last matching rule winning, its
// aliases, #uid and %#gid users, escapes, its own checks of the owner and
// mode of every file it reads (a world-writable or user-owned file in
// sudoers.d is ignored), and whatever else its policy plugin consults
// (LDAP, SSSD). A grant narrower than a shell as root (a list of commands,
// ALL as another user, ALL but the shell) is not counted: the operator
// names such an account with --api-allow-user if it should drive the shim.
const sudoProbe = "/bin/sh"

// sudoCandidates are where a host's sudo lives; one on PATH is not looked
// for (the caller's PATH is not the host's policy).
var sudoCandidates = [...]string{"/usr/bin/sudo", "/bin/sudo", "/usr/local/bin/sudo", "/usr/sbin/sudo"}

// DefaultSudoTimeout bounds one question to sudo: a policy that reaches
// a directory server must not hang the API's gate.
const DefaultSudoTimeout = 5 * time.Second

// errNoSudo means the host has no sudo: no account is root through it.
var errNoSudo = errors.New("sudo is not installed")

// sudoPath is the sudo to ask: Policy.Sudo, else the host's own when the
// policy reads the host itself (a fixture Root has no sudo of its own).
func (p *Policy) sudoPath() (string, error) {
	switch {
	case p.Sudo == "-":
		return "", errNoSudo
	case p.Sudo != "":
		return p.Sudo, nil
	case p.Root != "" && p.Root != "/":
		return "", errNoSudo
	}
	for _, c := range sudoCandidates {
		if fi, err := os.Stat(c); err == nil && fi.Mode().IsRegular() {
			return c, nil
		}
	}
	return "", errNoSudo
}

// sudoGrantsShell asks sudo whether the account name may run sudoProbe as
// root: `sudo -n -l -U name -u root /bin/sh` prints the command's path and
// exits 0 when it may, exits 1 when it may not. Anything else (a timeout,
// another status, an answer that is not the probe's path) is an error, and
// the account is refused.
func (p *Policy) sudoGrantsShell(ctx context.Context, name string) (bool, error) {
	sudo, err := p.sudoPath()
	if err != nil {
		return false, err
	}
	timeout := p.SudoTimeout
	if timeout <= 0 {
		timeout = DefaultSudoTimeout
	}
	// Nothing of the shim's environment reaches sudo (SUDO_* or a locale
	// changing its words); stdin is /dev/null, so nothing is ever asked.
	stdout, stderr, err := toolrun.Run(ctx, toolrun.Bounds{Timeout: timeout, Stdout: 4096, Stderr: 4096, WaitDelay: time.Second,
		Env: []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C"}},
		sudo, "-n", "-l", "-U", name, "-u", "root", "--", sudoProbe)
	var exit *exec.ExitError
	switch {
	case errors.Is(err, toolrun.ErrTimeout):
		return false, fmt.Errorf("sudo -l -U %s: no answer in %s", name, timeout)
	case errors.As(err, &exit) && exit.ExitCode() == 1:
		return false, nil
	case err != nil:
		return false, fmt.Errorf("sudo -l -U %s: %w: %s", name, err, firstLine(string(stderr)))
	}
	if got := firstLine(string(stdout)); got != sudoProbe {
		return false, fmt.Errorf("sudo -l -U %s answered %q, not %s", name, got, sudoProbe)
	}
	return true, nil
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(s)
}
