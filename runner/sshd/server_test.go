package sshd

import (
	"bytes"
	"testing"
)

func TestHostKeysPersist(t *testing.T) {
	dir := t.TempDir()
	first, err := hostKeys(dir)
	if err != nil || len(first) != 2 {
		t.Fatalf("%v %d", err, len(first))
	}
	if first[0].PublicKey().Type() != "ssh-ed25519" || first[1].PublicKey().Type() != "ecdsa-sha2-nistp256" {
		t.Fatalf("key types %s %s", first[0].PublicKey().Type(), first[1].PublicKey().Type())
	}
	again, err := hostKeys(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i := range first {
		if !bytes.Equal(first[i].PublicKey().Marshal(), again[i].PublicKey().Marshal()) {
			t.Fatal("a restart must keep the host identity")
		}
	}
}

func TestKeySet(t *testing.T) {
	var k KeySet
	if err := k.Add("not a key"); err == nil {
		t.Fatal("garbage keys are errors")
	}
	if err := k.Add("", "  "); err != nil {
		t.Fatal(err)
	}
}
