package cli

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/tandem-run/tandem/internal/doclinks"
)

// TestREADMECommandsExist: every `bin/tandem ...` line of the shell blocks
// of README.md, CONTRIBUTING.md and every doc under docs/ names a real command, and
// every flag it shows is one of that command's (or a global one): no doc
// can promise a command line the binary refuses.
func TestREADMECommandsExist(t *testing.T) {
	root := filepath.Join("..", "..")
	docs, err := doclinks.Docs(root)
	if err != nil {
		t.Fatal(err)
	}
	app := App()
	for _, path := range docs {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		name, _ := filepath.Rel(root, path)
		checked := checkCommandLines(t, app, name, string(b))
		t.Logf("%s: %d command lines", name, checked)
		// The pages that show the client at work must keep doing so:
		// a test that finds no lines there would pass for nothing.
		if want := map[string]int{"README.md": 6, filepath.Join("docs", "user-guide.md"): 12, filepath.Join("docs", "operator-guide.md"): 4}[name]; checked < want {
			t.Errorf("%s: only %d command lines found, want at least %d", name, checked, want)
		}
	}
}

// checkCommandLines checks the `bin/tandem` lines of one markdown file's
// fenced blocks and returns how many commands it checked.
func checkCommandLines(t *testing.T, app *cli.App, file, text string) int {
	t.Helper()
	checked := 0
	inBlock := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "```") {
			inBlock = !inBlock
			continue
		}
		if !inBlock || !strings.HasPrefix(line, "bin/tandem ") {
			continue
		}
		line, _, _ = strings.Cut(line, "#") // a comment
		rest := strings.TrimPrefix(line, "bin/tandem ")
		// "ps [-a] | attach NAME | logs [-f] ...": one command each.
		for _, alt := range strings.Split(rest, " | ") {
			fields := strings.Fields(alt)
			if len(fields) == 0 {
				continue
			}
			name := fields[0]
			cmd := app.Command(name)
			if cmd == nil {
				t.Errorf("%s: %q is not a tandem command (line %q)", file, name, line)
				continue
			}
			toks := fields[1:]
			if len(toks) > 0 && len(cmd.Subcommands) > 0 {
				if sub := cmd.Command(toks[0]); sub != nil {
					cmd, name, toks = sub, name+" "+toks[0], toks[1:]
				}
			}
			// Flags as urfave reads them: up to the first argument that is
			// not a flag or a flag's value (after it, the job's command).
			for i := 0; i < len(toks); i++ {
				tok := strings.Trim(toks[i], "[]")
				if tok == "--" || !strings.HasPrefix(tok, "-") {
					break
				}
				flag, _, hasValue := strings.Cut(strings.TrimLeft(tok, "-"), "=")
				f := findFlag(cmd, flag)
				if f == nil {
					t.Errorf("%s: tandem %s has no flag %s (line %q)", file, name, tok, line)
					continue
				}
				if _, isBool := f.(*cli.BoolFlag); !isBool && !hasValue {
					i++ // its value
				}
			}
			checked++
		}
	}
	return checked
}

func findFlag(cmd *cli.Command, name string) cli.Flag {
	for _, f := range cmd.Flags {
		if slices.Contains(f.Names(), name) {
			return f
		}
	}
	return nil
}
