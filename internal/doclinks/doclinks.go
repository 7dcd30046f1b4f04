// Package doclinks checks the relative links of markdown files: every link
// to another file names one that exists, and every #anchor names a heading
// (or an explicit <a id>) of the file it points into, with headings turned
// into anchors the way GitHub does. TestDocLinksResolve runs it on the
// README and docs/.
package doclinks

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"unicode"
)

// Broken is one link that does not resolve.
type Broken struct {
	File   string // the markdown file holding the link, as given
	Line   int    // 1-based
	Target string // the link as written
	Reason string
}

func (b Broken) String() string {
	return fmt.Sprintf("%s:%d: %s: %s", b.File, b.Line, b.Target, b.Reason)
}

// Docs lists the project's documents under root: README.md,
// CONTRIBUTING.md and every docs/*.md. It fails when docs/ holds none, so
// a check run from the wrong directory cannot pass for nothing.
func Docs(root string) ([]string, error) {
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		return nil, fmt.Errorf("docs under %s: %w", root, err)
	}
	if len(docs) == 0 {
		return nil, fmt.Errorf("no docs/*.md under %s", root)
	}
	return append([]string{filepath.Join(root, "README.md"), filepath.Join(root, "CONTRIBUTING.md")}, docs...), nil
}

// Check reads each markdown file and returns every relative link in it that
// does not resolve. Links with a scheme (https:, mailto:) are not checked.
func Check(files []string) ([]Broken, error) {
	anchors := map[string]map[string]bool{} // by cleaned path
	anchorsOf := func(path string) (map[string]bool, error) {
		if a, ok := anchors[path]; ok {
			return a, nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		a := Anchors(string(b))
		anchors[path] = a
		return a, nil
	}
	var broken []Broken
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, err
		}
		for _, l := range Links(string(b)) {
			if reason := resolve(file, l.Target, anchorsOf); reason != "" {
				broken = append(broken, Broken{File: file, Line: l.Line, Target: l.Target, Reason: reason})
			}
		}
	}
	return broken, nil
}

// resolve says why target, a link in file, does not resolve ("" when it
// does).
func resolve(file, target string, anchorsOf func(string) (map[string]bool, error)) string {
	if hasScheme(target) || strings.HasPrefix(target, "//") {
		return ""
	}
	pathPart, frag, _ := strings.Cut(target, "#")
	path := filepath.Clean(file)
	if pathPart != "" {
		p, err := url.PathUnescape(pathPart)
		if err != nil {
			return "not a valid path: " + err.Error()
		}
		if strings.HasPrefix(p, "/") {
			return "an absolute path: write it relative to the file"
		}
		path = filepath.Join(filepath.Dir(file), filepath.FromSlash(p))
		if _, err := os.Stat(path); err != nil {
			return "no such file"
		}
	}
	if frag == "" || !strings.EqualFold(filepath.Ext(path), ".md") {
		return ""
	}
	a, err := anchorsOf(path)
	if err != nil {
		return err.Error()
	}
	if !a[frag] {
		return fmt.Sprintf("no heading with anchor #%s in %s", frag, filepath.Base(path))
	}
	return ""
}

var schemeRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)

func hasScheme(s string) bool { return schemeRE.MatchString(s) }

// Link is one inline link or image: [text](target).
type Link struct {
	Line   int
	Target string
}

// linkRE finds "](target)" with an optional "title"; the target has no
// spaces, or is written <in angle brackets>.
var linkRE = regexp.MustCompile(`\]\((?:<([^>]*)>|([^()\s]*))(?:\s+"[^"]*")?\)`)

// Links returns the inline links of a markdown text outside fenced code
// blocks and code spans.
func Links(text string) []Link {
	var out []Link
	fence := ""
	for i, line := range strings.Split(text, "\n") {
		if f := fenceOf(line); f != "" {
			switch {
			case fence == "":
				fence = f
			case strings.HasPrefix(f, fence):
				fence = ""
			}
			continue
		}
		if fence != "" {
			continue
		}
		for _, m := range linkRE.FindAllStringSubmatch(stripCode(line), -1) {
			t := m[1] + m[2]
			if t != "" {
				out = append(out, Link{Line: i + 1, Target: t})
			}
		}
	}
	return out
}

// fenceOf returns the fence a line opens or closes (``` or ~~~, three or
// more), or "".
func fenceOf(line string) string {
	l := strings.TrimLeft(line, " ")
	if len(line)-len(l) > 3 {
		return ""
	}
	for _, c := range []string{"`", "~"} {
		n := len(l) - len(strings.TrimLeft(l, c))
		if n >= 3 {
			return strings.Repeat(c, n)
		}
	}
	return ""
}

// stripCode drops the code spans of a line (one backtick or more): a link
// written in code is an example, not a link.
func stripCode(line string) string {
	var b strings.Builder
	for {
		i := strings.Index(line, "`")
		if i < 0 {
			b.WriteString(line)
			return b.String()
		}
		n := len(line[i:]) - len(strings.TrimLeft(line[i:], "`"))
		tick := line[i : i+n]
		end := strings.Index(line[i+n:], tick)
		if end < 0 {
			b.WriteString(line)
			return b.String()
		}
		b.WriteString(line[:i])
		line = line[i+n+end+n:]
	}
}

var (
	headingRE  = regexp.MustCompile(`^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$`)
	explicitRE = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)
	inlineLink = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
)

// Anchors returns the anchors a markdown text defines: one per ATX heading,
// as GitHub makes them (a repeated heading gets -1, -2, ...), and every
// <a id="..."> or <a name="...">.
func Anchors(text string) map[string]bool {
	a := map[string]bool{}
	seen := map[string]int{}
	fence := ""
	for _, line := range strings.Split(text, "\n") {
		if f := fenceOf(line); f != "" {
			switch {
			case fence == "":
				fence = f
			case strings.HasPrefix(f, fence):
				fence = ""
			}
			continue
		}
		if fence != "" {
			continue
		}
		for _, m := range explicitRE.FindAllStringSubmatch(line, -1) {
			a[m[1]] = true
		}
		m := headingRE.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		s := Slug(m[2])
		if n := seen[s]; n > 0 {
			a[fmt.Sprintf("%s-%d", s, n)] = true
		} else {
			a[s] = true
		}
		seen[s]++
	}
	return a
}

// Slug is GitHub's anchor for a heading's text: links become their text,
// then lower case, every character that is not a letter, a digit, a space,
// '-' or '_' dropped, and spaces made '-'.
func Slug(heading string) string {
	heading = inlineLink.ReplaceAllString(heading, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}
