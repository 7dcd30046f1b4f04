package doclinks

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestDocLinksResolve: every relative link of the README, CONTRIBUTING and
// docs/*.md points at a file that exists and, for an #anchor, at a heading
// of that file.
func TestDocLinksResolve(t *testing.T) {
	root := filepath.Join("..", "..")
	files, err := Docs(root)
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		total += len(Links(string(b)))
	}
	// The README links to every doc: a checker that finds no links has
	// checked nothing.
	if total < len(files)-2 {
		t.Fatalf("only %d links found in %d files", total, len(files))
	}
	broken, err := Check(files)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range broken {
		t.Error(b)
	}
	t.Logf("%d links in %d files", total, len(files))
}

func TestSlug(t *testing.T) {
	for _, tc := range []struct{ heading, want string }{
		{"Set-up (fresh Debian/Ubuntu, as root)", "set-up-fresh-debianubuntu-as-root"},
		{"3. Images with everything baked in (Packer)", "3-images-with-everything-baked-in-packer"},
		{"Restarts and other agents' containers", "restarts-and-other-agents-containers"},
		{"Tandem's additions", "tandems-additions"},
		{"`tandem run` over a long link", "tandem-run-over-a-long-link"},
		{"See [the guide](docs/x.md) now", "see-the-guide-now"},
		{"snake_case and UPPER", "snake_case-and-upper"},
	} {
		if got := Slug(tc.heading); got != tc.want {
			t.Errorf("Slug(%q) = %q, want %q", tc.heading, got, tc.want)
		}
	}
}

func TestAnchors(t *testing.T) {
	text := "# Title\n\n## Usage\n\n## Usage\n\n```\n## Not a heading\n```\n\n" +
		"### Closed heading ###\n<a id=\"custom\"></a>text\n"
	a := Anchors(text)
	for _, want := range []string{"title", "usage", "usage-1", "closed-heading", "custom"} {
		if !a[want] {
			t.Errorf("anchor %q missing from %v", want, a)
		}
	}
	if a["not-a-heading"] {
		t.Error("a line in a code block made an anchor")
	}
}

func TestLinksSkipCode(t *testing.T) {
	text := "see [a](a.md) and `[b](b.md)`\n```\n[c](c.md)\n```\n[d](<d e.md> \"title\") ![img](i.png)\n"
	var got []string
	for _, l := range Links(text) {
		got = append(got, l.Target)
	}
	if want := []string{"a.md", "d e.md", "i.png"}; !slices.Equal(got, want) {
		t.Fatalf("links %q, want %q", got, want)
	}
}

// Check finds each kind of broken link, and only those.
func TestCheckFindsBrokenLinks(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("docs/guide.md", "# Guide\n\n## Install it\n")
	write("LICENSE", "x")
	readme := write("README.md", strings.Join([]string{
		"# Top",
		"[ok](docs/guide.md) [ok](docs/guide.md#install-it) [ok](#top) [ok](LICENSE) [ok](https://example.com/x.md#nope)",
		"[gone](docs/missing.md)",
		"[bad anchor](docs/guide.md#install)",
		"[bad self](#bottom)",
		"[abs](/docs/guide.md)",
	}, "\n"))
	guide := filepath.Join(dir, "docs", "guide.md")
	write("docs/other.md", "[up](../README.md#top) [up bad](../README.md#nope)\n")
	broken, err := Check([]string{readme, guide, filepath.Join(dir, "docs", "other.md")})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, b := range broken {
		got = append(got, filepath.Base(b.File)+" "+b.Target)
	}
	want := []string{
		"README.md docs/missing.md",
		"README.md docs/guide.md#install",
		"README.md #bottom",
		"README.md /docs/guide.md",
		"other.md ../README.md#nope",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("broken:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
