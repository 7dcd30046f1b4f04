package cli

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/creack/pty"
	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/ctl"
)

func TestParseSizeAndGPUs(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"", 0, true}, {"512MiB", 512 << 20, true}, {"8GiB", 8 << 30, true}, {"1.5G", 3 << 29, true},
		{"2GB", 2e9, true}, {"100", 100, true}, {"-1G", 0, false}, {"lots", 0, false}, {"8 GiB", 8 << 30, true},
		// docker's lowercase forms, binary as docker reads them
		{"8g", 8 << 30, true}, {"512m", 512 << 20, true}, {"1k", 1 << 10, true}, {"64b", 64, true}, {"1kib", 0, false},
	} {
		got, err := parseSize(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseSize(%q) = %d, %v", tc.in, got, err)
		}
	}
	for in, want := range map[string]int{"0": 0, "2": 2, "all": -1} {
		if got, err := parseGPUs(in); err != nil || got != want {
			t.Errorf("parseGPUs(%q) = %d, %v", in, got, err)
		}
	}
	if _, err := parseGPUs("-3"); err == nil {
		t.Error("negative GPU counts must be rejected")
	}
}

// TestAliasCannotShadowAHost: every alias carries the tandem- prefix and no
// dot, so a task named for a real host or an address cannot take over
// `ssh NAME`; a bad name falls back to the short id.
func TestAliasCannotShadowAHost(t *testing.T) {
	for name, want := range map[string]string{"train-1": "tandem-train-1", "github.com": "tandem-github-com", "10.0.0.1": "tandem-10-0-0-1",
		"prod": "tandem-prod", "": "tandem-abcdef12", "bad\nHost *": "tandem-abcdef12", "a b": "tandem-abcdef12"} {
		info := api.TaskInfoResponse{ID: "abcdef12-0000", Tandem: &api.TaskDetails{Name: name}}
		if got := alias(info); got != want {
			t.Errorf("alias(%q) = %q, want %q", name, got, want)
		}
	}
}

// --code-limit is the size the code is checked against before anything is
// made; a shim that cannot be reached is not asked first.
func TestCodeLimitFlag(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "data"), make([]byte, 2<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(limit string) error {
		return runTandem("run", "--shim", "127.0.0.1:1", "--no-ssh-config", "--code", dir, "--code-limit", limit, "--", "true")
	}
	if err := run("1MiB"); err == nil || !strings.Contains(err.Error(), "takes at most 1MiB") {
		t.Fatalf("--code-limit 1MiB: %v", err)
	}
	if err := run("0"); err == nil || strings.Contains(err.Error(), "takes at most") {
		t.Fatalf("--code-limit 0 (no check) refused the code: %v", err)
	}
	if err := run("lots"); err == nil || !strings.Contains(err.Error(), "--code-limit") {
		t.Fatalf("--code-limit lots: %v", err)
	}
}

// -v, --volume and --mount take /host/path:/container/path[:ro|:rw] or
// docker's type=bind,source=,target=[,readonly]; anything else is refused
// before anything is made, never read as the container path "/b:ro". A
// host path that does not exist on this machine (the shim's) is refused
// too: it is never created.
func TestMountFlag(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nonexistent")
	run := func(m string) error {
		return runTandem("run", "--shim", "127.0.0.1:1", "--no-ssh-config", "-v", m, "--", "true")
	}
	for m, want := range map[string]string{
		"/tmp:/data:rx":           `mount "/tmp:/data:rx": option "rx": want ro or rw`,
		"/a:/b:c:d":               `mount "/a:/b:c:d": want /host/path:/container/path[:ro]`,
		"rel:/x":                  `mount "rel:/x": "rel" is a docker named volume; the shim binds host paths only`,
		"/tmp:rel":                "want /host/path:/container/path",
		"/tmp":                    "want /host/path:/container/path",
		"type=volume,src=a,dst=b": "only type=bind",
		missing + ":/data":        "mount " + missing + ":/data: " + missing + " does not exist; a mount's host path is never created: make it first (mkdir -p " + missing + ")",
	} {
		if err := run(m); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("-v %s: %v, want %q", m, err, want)
		}
	}
	if _, err := os.Stat(missing); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused mount made its host path: %v", err)
	}
	// Well-formed mounts pass the flag's checks: the run fails only on
	// the unreachable shim.
	for _, m := range []string{"/tmp:/x", "/tmp:/x:ro", "type=bind,source=/tmp,target=/x,readonly"} {
		if err := run(m); err == nil || strings.Contains(err.Error(), "mount") || !strings.Contains(err.Error(), "not reachable") {
			t.Errorf("-v %s: %v", m, err)
		}
	}
}

// -e takes each value whole, in command-line order across --env and -e
// (urfave's slices split at commas: LIST=a,b failed as a bad "b"), and a
// bare KEY passes this machine's value, or nothing when it has none, as
// docker run does.
func TestRunEnvFlags(t *testing.T) {
	var got ctl.RunOptions
	app := App()
	for _, cmd := range app.Commands {
		if cmd.Name == "run" {
			cmd.Action = func(c *cli.Context) error {
				var err error
				got, err = runOptions(c, c.Args().Slice(), "127.0.0.1:1", false)
				return err
			}
		}
	}
	app.Writer, app.ErrWriter = io.Discard, io.Discard
	t.Setenv("TANDEM_TEST_FROM_HERE", "here,too")
	src := filepath.Join(t.TempDir(), "data,x") // a mount's host path must exist
	if err := os.Mkdir(src, 0o755); err != nil {
		t.Fatal(err)
	}
	argv := []string{"tandem", "run", "--no-ssh-config", "-e", "LIST=a,b", "--env", "A=1", "-e", "A=2", "-e", "TANDEM_TEST_FROM_HERE",
		"-e", "TANDEM_TEST_UNSET_XYZ", "--mount", src + ":/in,y", "--authorized-key", `from="10.0.0.1,10.0.0.2" ssh-ed25519 AAAA k`, "--", "true"}
	if err := app.Run(argv); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"LIST": "a,b", "A": "2", "TANDEM_TEST_FROM_HERE": "here,too"}
	if len(got.Env) != len(want) {
		t.Errorf("env %v, want %v", got.Env, want)
	}
	for k, v := range want {
		if got.Env[k] != v {
			t.Errorf("env %s=%q, want %q (all: %v)", k, got.Env[k], v, got.Env)
		}
	}
	if len(got.Mounts) != 1 || got.Mounts[0].InstancePath != src || got.Mounts[0].Path != "/in,y" {
		t.Errorf("mounts %+v", got.Mounts)
	}
	if len(got.SSHKeys) != 1 || !strings.HasPrefix(got.SSHKeys[0], `from="10.0.0.1,10.0.0.2"`) {
		t.Errorf("keys %q", got.SSHKeys)
	}
}

// With no SSH key of the user's, a detached run warns that tandem ssh
// will not get into its task; a run followed to its end (make demo's)
// says nothing about a key it does not use.
func TestNoKeyWarningOnlyForDetachedRuns(t *testing.T) {
	t.Setenv("HOME", t.TempDir())
	for _, detach := range []bool{false, true} {
		app := App()
		for _, cmd := range app.Commands {
			if cmd.Name == "run" {
				cmd.Action = func(c *cli.Context) error {
					_, err := runOptions(c, c.Args().Slice(), "127.0.0.1:1", false)
					return err
				}
			}
		}
		var errb strings.Builder
		app.Writer, app.ErrWriter = io.Discard, &errb
		argv := []string{"tandem", "run", "--no-ssh-config"}
		if detach {
			argv = append(argv, "-d")
		}
		if err := app.Run(append(argv, "--", "true")); err != nil {
			t.Fatal(err)
		}
		if warned := strings.Contains(errb.String(), "no SSH public key found"); warned != detach {
			t.Errorf("detached %v: warned %v: %q", detach, warned, errb.String())
		}
	}
}

// A negative --max-duration (read as none before) or --cpu is refused
// before anything is made, each blaming only itself.
func TestNegativeLimitsRefused(t *testing.T) {
	for flag, want := range map[string]string{
		"--max-duration=-5s": "--max-duration -5s: want a positive duration, e.g. 30m (0: none)",
		"--cpu=-1":           "--cpu -1: want a positive count of cores, e.g. 1.5 (0: no limit)",
	} {
		if err := runTandem("run", "--shim", "127.0.0.1:1", "--no-ssh-config", flag, "--", "true"); err == nil || err.Error() != want {
			t.Errorf("%s: %v, want %q", flag, err, want)
		}
	}
}

func runTandem(args ...string) error { return runTandemTo(io.Discard, args...) }

// runTandemTo is runTandem with the CLI's stdout going to stdout.
func runTandemTo(stdout io.Writer, args ...string) error {
	app := App()
	argv, err := dockerArgs(app, append([]string{"tandem"}, args...), io.Discard)
	if err != nil {
		return err
	}
	app.Metadata = map[string]any{argvKey: argv}
	app.Writer, app.ErrWriter = stdout, io.Discard
	var failed error
	app.ExitErrHandler = func(_ *cli.Context, err error) { failed = err }
	if err := app.Run(argv); err != nil {
		return err
	}
	return failed
}

// cp TASK:PATH - refuses to write the tar to a terminal (a job's bytes,
// escape sequences included, would drive it), before any shim is asked.
func TestCopyTarRefusesATerminal(t *testing.T) {
	_, tty := openPTY(t)
	args := []string{"cp", "--shim", "127.0.0.1:1", "t1:/x", "-"}
	if err := runTandemTo(tty, args...); err == nil || !strings.Contains(err.Error(), "to a terminal") {
		t.Fatalf("cp to a terminal: %v", err)
	}
	// Not a terminal: the copy goes on, to the shim (not there: refused).
	if err := runTandem(args...); err == nil || strings.Contains(err.Error(), "to a terminal") {
		t.Fatalf("cp to a pipe: %v", err)
	}
}

// openPTY opens a pseudo-terminal for the test: its master and its tty.
func openPTY(t *testing.T) (ptmx, tty *os.File) {
	t.Helper()
	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ptmx.Close(); tty.Close() })
	return ptmx, tty
}

// A job's output to a terminal goes through ctl.TerminalSafe (a query a
// job writes never makes the terminal type its answer); to anything else
// it is left as it is.
func TestJobOutputOnATerminalDropsQueries(t *testing.T) {
	ptmx, tty := openPTY(t)
	if _, err := terminalSafe(tty).Write([]byte("a\x1b[6nb\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, _ := ptmx.Read(buf)
	if got := string(buf[:n]); got != "ab\r\n" { // the line discipline's ONLCR
		t.Fatalf("on a terminal: %q", got)
	}
	var b strings.Builder
	if w := terminalSafe(&b); w != io.Writer(&b) {
		t.Fatalf("not a terminal: wrapped as %T", w)
	}
}

// TestKeptText: an interrupted run names every task it kept, one for a
// single-node run, one per host for a multi-node run.
func TestKeptText(t *testing.T) {
	one := keptText(ctl.Result{Name: "train", Kept: true, KeptNames: []string{"train"}})
	if one != "interrupted: task train was stopped (tandem logs train; tandem rm train removes it)" {
		t.Errorf("one task: %q", one)
	}
	if got := keptText(ctl.Result{Name: "train", Kept: true}); got != one {
		t.Errorf("no names falls back to the run's name: %q", got)
	}
	many := keptText(ctl.Result{Name: "mn", Kept: true, KeptNames: []string{"mn-0", "mn-1"}})
	if !strings.HasPrefix(many, "interrupted: tasks mn-0 mn-1 were stopped, one per host") {
		t.Errorf("two tasks: %q", many)
	}
}
