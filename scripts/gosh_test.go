// Package scripts holds the build's shell scripts; its tests run them for
// real against stand-ins for what they would fetch.
package scripts

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// fakeGo is a stand-in go: it says it is Go VERSION, and a module
// download of the toolchain answers with the fake toolchain in TOOLCHAIN
// (as the module cache would hold it); every call is recorded.
const fakeGo = `#!/bin/sh
echo "$0 $*" >>%[3]q
case "$1 $2" in
"env GOVERSION") echo go%[1]s ;;
"mod download") echo '{'; echo '	"Path": "golang.org/toolchain",'; echo '	"Dir": "%[2]s",'; echo '}' ;;
*) exit 2 ;;
esac
`

// TestGoScriptUsesAGoThatBuildsTheModule: scripts/go.sh, which make demo,
// make deps and the Makefile ask for the Go to build with, uses a Go
// already on the machine that is as new as go.mod's go line (the one on
// the PATH first, by its own directory when the PATH has a link to it),
// and leaves every other Go as it was; with only older ones, --find says
// so and fetches nothing, and a plain run fetches go.mod's toolchain into
// its own directory under the cache, never over the system's Go, and
// finds it there afterwards.
func TestGoScriptUsesAGoThatBuildsTheModule(t *testing.T) {
	mod, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	need := regexp.MustCompile(`(?m)^go ([0-9.]+)$`).FindSubmatch(mod)
	tool := regexp.MustCompile(`(?m)^toolchain go([0-9.]+)$`).FindSubmatch(mod)
	if need == nil || tool == nil {
		t.Fatalf("go.mod has no go or toolchain line:\n%s", mod)
	}
	goLine, toolchain := string(need[1]), string(tool[1])

	dir := t.TempDir()
	calls := filepath.Join(dir, "calls")
	// The toolchain the download "finds": a go that is toolchain's version.
	fetched := filepath.Join(dir, "modcache", "toolchain")
	mkGo := func(path, version string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, fmt.Appendf(nil, fakeGo, version, fetched, calls), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mkGo(filepath.Join(fetched, "bin", "go"), toolchain)
	if err := os.MkdirAll(filepath.Join(fetched, "pkg", "tool", "linux_amd64"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(fetched, "pkg", "tool", "linux_amd64", "compile"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	system := filepath.Join(dir, "usr-local-go", "bin", "go")
	cache := filepath.Join(dir, "cache")
	private := filepath.Join(cache, "tandem", "go"+toolchain)

	run := func(pathGo, systemVersion string, args ...string) (stdout, stderr string, err error) {
		t.Helper()
		bin := filepath.Join(dir, "bin")
		_ = os.RemoveAll(bin)
		if err := os.MkdirAll(bin, 0o755); err != nil {
			t.Fatal(err)
		}
		if pathGo != "" {
			// A distribution's layout: the PATH's go links to its root.
			root := filepath.Join(dir, "lib", "go-"+pathGo, "bin", "go")
			mkGo(root, pathGo)
			if err := os.Symlink(root, filepath.Join(bin, "go")); err != nil {
				t.Fatal(err)
			}
		}
		mkGo(system, systemVersion)
		cmd := exec.Command("./go.sh", args...)
		cmd.Env = []string{"PATH=" + bin + ":/usr/bin:/bin", "HOME=" + dir, "XDG_CACHE_HOME=" + cache, "TANDEM_SYSTEM_GO=" + system}
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err = cmd.Run()
		return out.String(), errb.String(), err
	}
	systemIs := func(version string) {
		t.Helper()
		b, err := os.ReadFile(system)
		if err != nil || !strings.Contains(string(b), "echo go"+version+" ") {
			t.Fatalf("the system's Go was changed: %v\n%s", err, b)
		}
	}

	// A Go on the PATH as new as the go line (older than the toolchain
	// line) is used, by its own directory; the newer system Go is not
	// needed, nothing is fetched.
	out, errs, err := run(goLine, toolchain)
	if want := filepath.Join(dir, "lib", "go-"+goLine, "bin") + "\n"; err != nil || out != want {
		t.Fatalf("a Go on the PATH that builds the module: %v %q (want %q)\n%s", err, out, want, errs)
	}
	systemIs(toolchain)
	if _, err := os.Stat(private); !os.IsNotExist(err) {
		t.Fatalf("a toolchain was fetched although one was here: %v", err)
	}

	// The PATH's Go too old, the system's fine: the system's.
	out, errs, err = run("1.19.8", goLine)
	if want := filepath.Dir(system) + "\n"; err != nil || out != want {
		t.Fatalf("the system Go: %v %q (want %q)\n%s", err, out, want, errs)
	}

	// Both too old: --find fetches nothing and says what would be done.
	out, errs, err = run("1.19.8", "1.25.3", "--find")
	if err == nil || out != "" || !strings.Contains(errs, "no Go "+goLine+" or newer here") || !strings.Contains(errs, private) {
		t.Fatalf("--find with only old Go: %v %q\n%s", err, out, errs)
	}
	if _, err := os.Stat(private); !os.IsNotExist(err) {
		t.Fatalf("--find fetched: %v", err)
	}
	// A plain run fetches go.mod's toolchain with the PATH's Go into the
	// private dir; the system's Go stays as it was.
	_ = os.Remove(calls)
	out, errs, err = run("1.19.8", "1.25.3")
	if want := filepath.Join(private, "bin") + "\n"; err != nil || out != want {
		t.Fatalf("the fetch: %v %q (want %q)\n%s", err, out, want, errs)
	}
	systemIs("1.25.3")
	rec, _ := os.ReadFile(calls)
	if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(filepath.Join(dir, "bin", "go")) + ` mod download -json golang.org/toolchain@v0\.0\.1-go` + regexp.QuoteMeta(toolchain) + `\.linux-(amd64|arm64)$`).Match(rec) {
		t.Fatalf("the toolchain was not fetched with the PATH's Go:\n%s", rec)
	}
	if fi, err := os.Stat(filepath.Join(private, "pkg", "tool", "linux_amd64", "compile")); err != nil || fi.Mode()&0o111 == 0 {
		t.Fatalf("the fetched tools are not executable: %v", err)
	}
	// And it is found there from now on, with --find too.
	out, errs, err = run("1.19.8", "1.25.3", "--find")
	if want := filepath.Join(private, "bin") + "\n"; err != nil || out != want {
		t.Fatalf("the fetched Go is not found: %v %q\n%s", err, out, errs)
	}
}
