package version

import (
	"regexp"
	"testing"
)

// PEP 440 public version with a local label: what the server's parser takes as
// (major, minor, micro) while ignoring the label.
var pep440Local = regexp.MustCompile(`^\d+\.\d+\.\d+\+[a-z0-9]+(\.[a-z0-9]+)*$`)

func TestStringIsPEP440WithLocalLabel(t *testing.T) {
	s := String()
	if !pep440Local.MatchString(s) {
		t.Fatalf("%q is not a PEP 440 version with a local label", s)
	}
	if s[:len(ProtocolLevel)] != ProtocolLevel {
		t.Fatalf("%q must start with the protocol level %q", s, ProtocolLevel)
	}
}
