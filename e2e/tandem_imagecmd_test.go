package e2e

import (
	"fmt"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestTandemRunImagesOwnCommand: `tandem run IMAGE` with no command runs
// the image's ENTRYPOINT then CMD, argv exact, in its WORKDIR and as its
// USER (unless --workdir names another dir), and exits with its status,
// as docker run does; an image with only a CMD runs that; one with
// neither is refused with what to do, and leaves no task behind.
func TestTandemRunImagesOwnCommand(t *testing.T) {
	_, shim, rport := realStack(t)
	base := testenv.Busybox(t)
	both := buildImage(t, "entrypoint-cmd", map[string][]byte{"Dockerfile": fmt.Appendf(nil,
		"FROM %s\nRUN mkdir /srv && chown 1000 /srv\nWORKDIR /srv\nUSER 1000\n"+
			`ENTRYPOINT ["/bin/sh", "-c", "echo \"entrypoint: [$0] [$1] in $(pwd) as $(id -u)\"; exit 3"]`+"\n"+
			`CMD ["two words", "it's"]`+"\n", base)})
	cmdOnly := buildImage(t, "cmd-only", map[string][]byte{"Dockerfile": fmt.Appendf(nil,
		"FROM %s\n"+`CMD ["/bin/echo", "cmd only:", "a  b", "$HOME"]`+"\n", base)})
	neither := buildImage(t, "no-cmd", map[string][]byte{"Dockerfile": fmt.Appendf(nil, "FROM %s\nCMD []\n", base)})
	run := func(args ...string) (stdout, stderr string, code int) {
		t.Helper()
		cmd, out, errb := tandem(t, append([]string{"run", "--rm", "--shim", shim, "--runner-port", rport, "--no-ssh-config"}, args...)...)
		err := cmd.Run()
		return out.String(), errb.String(), exitCodeOf(err)
	}

	out, errs, code := run(both)
	if want := "entrypoint: [two words] [it's] in /srv as 1000\n"; out != want || code != 3 {
		t.Fatalf("ENTRYPOINT and CMD: exit %d, %q (want exit 3, %q)\n%s", code, out, want, tailStr(errs, 800))
	}
	// What it runs is a status line: a terminal's only, as the others.
	if strings.Contains(errs, "running the image's command") {
		t.Errorf("a status line on a stderr that is no terminal: %s", errs)
	}
	out, errs, code = run("--workdir", "/tmp", both)
	if want := "entrypoint: [two words] [it's] in /tmp as 1000\n"; out != want || code != 3 {
		t.Fatalf("--workdir over the image's WORKDIR: exit %d, %q (want %q)\n%s", code, out, want, tailStr(errs, 800))
	}
	out, errs, code = run(cmdOnly)
	if want := "cmd only: a  b $HOME\n"; out != want || code != 0 {
		t.Fatalf("CMD only: exit %d, %q (want exit 0, %q)\n%s", code, out, want, tailStr(errs, 800))
	}
	out, errs, code = run(neither)
	if want := "tandem: no command: image " + neither + " has no ENTRYPOINT or CMD: give the command to run\n"; code != 125 || !strings.HasSuffix(errs, want) || out != "" {
		t.Fatalf("neither: exit %d, stdout %q, stderr %q (want exit 125 and a stderr ending %q)", code, out, errs, want)
	}
	if left := taskContainers(t); left != "" {
		t.Fatalf("containers left behind: %s", left)
	}
}
