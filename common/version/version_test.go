package version

import (
	"regexp"
	"strings"
	"testing"
)

// A final PEP 440 release, major.minor.micro: what the server's parser
// takes as a version tuple. No local label: the server compares strings.
var finalRelease = regexp.MustCompile(`^\d+\.\d+\.\d+$`)

func TestStringIsAFinalDstackRelease(t *testing.T) {
	if s := String(); !finalRelease.MatchString(s) {
		t.Fatalf("%q is not a final dstack release", s)
	}
	if !finalRelease.MatchString(ProtocolLevel) {
		t.Fatalf("protocol level %q", ProtocolLevel)
	}
}

func TestVerboseCarriesBoth(t *testing.T) {
	v := Verbose("dstack-shim")
	if !strings.HasPrefix(v, "dstack-shim version "+String()+"\n") || !strings.Contains(v, "tandem "+Tandem()) {
		t.Fatalf("%q", v)
	}
}
