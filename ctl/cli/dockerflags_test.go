package cli

import (
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// Docker's run and exec flags as docker users type them: grouped short
// flags split, -i is docker's (an -i before a private key file is the
// old --identity, said deprecated), and a docker flag tandem lacks is
// refused with what to use instead, named as it was typed.
func TestDockerArgs(t *testing.T) {
	key := filepath.Join(t.TempDir(), "id_ed25519")
	if err := os.WriteFile(key, []byte("-----BEGIN OPENSSH PRIVATE KEY-----\nxx\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	app := App()
	for _, tc := range []struct {
		in, want []string
		warn     string
	}{
		{[]string{"run", "-it", "img", "sh"}, []string{"run", "--interactive", "-t", "img", "sh"}, ""},
		{[]string{"run", "-dit", "--name", "x", "img"}, []string{"run", "-d", "--interactive", "-t", "--name", "x", "img"}, ""},
		{[]string{"run", "-i", key, "img", "true"}, []string{"run", "--identity", key, "img", "true"}, "deprecated"},
		{[]string{"run", "-i", "img", "cat"}, []string{"run", "--interactive", "img", "cat"}, ""},
		{[]string{"run", "--rm", "-v", "/a:/b:ro", "-w", "/w", "-u", "1000", "img", "ls", "-it"}, []string{"run", "--rm", "-v", "/a:/b:ro", "-w", "/w", "-u", "1000", "img", "ls", "-it"}, ""},
		{[]string{"exec", "-it", "task", "sh"}, []string{"exec", "--interactive", "-t", "task", "sh"}, ""},
		{[]string{"ps", "-x"}, []string{"ps", "-x"}, ""}, // not run or exec: urfave's
	} {
		var warn strings.Builder
		got, err := dockerArgs(app, append([]string{"tandem"}, tc.in...), &warn)
		if err != nil || !slices.Equal(got[1:], tc.want) || !strings.Contains(warn.String(), tc.warn) || tc.warn == "" && warn.Len() > 0 {
			t.Errorf("%q: %q %v (warned %q), want %q", tc.in, got, err, warn.String(), tc.want)
		}
	}
	for args, want := range map[string]string{
		"run -P img":                "tandem run has no -P (docker's): tandem publishes only the ports you name: give each with -p HOST_PORT:CONTAINER_PORT",
		"run --publish-all img":     "tandem run has no --publish-all (docker's): tandem publishes only the ports you name",
		"run --cap-add SYS_ADMIN x": "tandem run has no --cap-add (docker's): the shim's protocol has no capabilities: --privileged gives the job all of them",
		"run --env-file f img":      "tandem run has no --env-file (docker's): give each variable with -e KEY=VALUE",
		"run --frobnicate img":      "tandem run has no flag --frobnicate (tandem run --help lists them)",
		"run -X img":                "tandem run has no flag -X (tandem run --help lists them)",
		"exec --detach-keys x t sh": "tandem exec has no flag --detach-keys (tandem exec --help lists them)",
	} {
		_, err := dockerArgs(app, append([]string{"tandem"}, strings.Fields(args)...), nil)
		if err == nil || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("%s: %v, want %q", args, err, want)
		}
	}
}

// An address that is no host:port is refused in one line with what to
// give; a host alone gets dstack's port, as docker's -H gets docker's.
func TestShimAddr(t *testing.T) {
	for in, want := range map[string]string{"127.0.0.1": "127.0.0.1:10998", "host.example": "host.example:10998", "http://10.0.0.5:8000/": "10.0.0.5:8000",
		"::1": "[::1]:10998", "[::1]:9": "[::1]:9", "127.0.0.1:10998": "127.0.0.1:10998"} {
		if got, err := shimAddr(in); err != nil || got != want {
			t.Errorf("%q: %q %v, want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "127.0.0.1:port", "127.0.0.1:70000", "a b", "https://x:1", ":80"} {
		if got, err := shimAddr(in); err == nil {
			t.Errorf("%q: %q, want a refusal", in, got)
		}
	}
	if err := runTandem("ps", "--shim", "127.0.0.1:port"); err == nil || err.Error() != `--shim "127.0.0.1:port": want HOST[:PORT], e.g. 127.0.0.1:10998` {
		t.Errorf("ps --shim 127.0.0.1:port: %v", err)
	}
}

// Every command that reaches the shim words an unreachable one the same
// way, whatever it was doing.
func TestShimUnreachableOneVoice(t *testing.T) {
	want := "shim at 127.0.0.1:1 is not reachable (connection refused); is dstack-shim running there?\n" + shimUnreachableHint
	for _, args := range [][]string{{"run", "img", "true"}, {"ps"}, {"logs", "x"}, {"stop", "x"}, {"rm", "x"}, {"wait", "x"}, {"attach", "x"}, {"info"}, {"prune"}, {"stats", "x"}, {"exec", "x", "sh"}, {"ssh", "x"}, {"cp", "x:/a", "/tmp/b"}} {
		if args[0] == "run" {
			args = append(args[:1:1], append([]string{"--no-ssh-config"}, args[1:]...)...)
		}
		var stderr strings.Builder
		app := App()
		argv := append([]string{"tandem", args[0], "--shim", "127.0.0.1:1"}, args[1:]...)
		app.Metadata = map[string]any{argvKey: argv}
		app.Writer, app.ErrWriter = io.Discard, &stderr
		var err error
		app.ExitErrHandler = func(_ *cli.Context, e error) { err = e }
		if e := app.Run(argv); e != nil {
			err = e
		}
		if err == nil || !strings.Contains(err.Error(), want) && !strings.Contains(stderr.String(), want) {
			t.Errorf("%v: %v", args, err)
		}
	}
}
