package repo

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestApplyDiff(t *testing.T) {
	dir := t.TempDir()
	_ = os.WriteFile(filepath.Join(dir, "a.py"), []byte("one\ntwo\nthree\n"), 0o644)
	_ = os.WriteFile(filepath.Join(dir, "gone.txt"), []byte("bye\n"), 0o644)
	_ = os.WriteFile(filepath.Join(dir, "old.txt"), []byte("same\n"), 0o644)
	diff := `diff --git a/a.py b/a.py
index 1111111..2222222 100644
--- a/a.py
+++ b/a.py
@@ -1,3 +1,3 @@
 one
-two
+TWO
 three
diff --git a/gone.txt b/gone.txt
deleted file mode 100644
index 3333333..0000000
--- a/gone.txt
+++ /dev/null
@@ -1 +0,0 @@
-bye
diff --git a/sub/new.sh b/sub/new.sh
new file mode 100755
index 0000000..4444444
--- /dev/null
+++ b/sub/new.sh
@@ -0,0 +1 @@
+echo new
diff --git a/old.txt b/renamed.txt
similarity index 100%
rename from old.txt
rename to renamed.txt
`
	p := filepath.Join(t.TempDir(), "diff")
	_ = os.WriteFile(p, []byte(diff), 0o644)
	if err := applyDiffFile(dir, p); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "a.py")); string(b) != "one\nTWO\nthree\n" {
		t.Fatalf("a.py %q", b)
	}
	if _, err := os.Stat(filepath.Join(dir, "gone.txt")); !os.IsNotExist(err) {
		t.Fatal("deleted file remains")
	}
	if fi, err := os.Stat(filepath.Join(dir, "sub", "new.sh")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("new file: %v %v", fi, err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "renamed.txt")); string(b) != "same\n" {
		t.Fatalf("rename %q", b)
	}
	if _, err := os.Stat(filepath.Join(dir, "old.txt")); !os.IsNotExist(err) {
		t.Fatal("rename source remains")
	}
	// A hunk that does not match fails the setup, and a path escaping the
	// repo is refused.
	_ = os.WriteFile(p, []byte(strings.Replace(diff[:strings.Index(diff, "diff --git a/gone")], "-two", "-zwei", 1)), 0o644)
	if err := applyDiffFile(dir, p); err == nil {
		t.Fatal("mismatching hunk must fail")
	}
	_ = os.WriteFile(p, []byte("diff --git a/../x b/../x\nnew file mode 100644\n--- /dev/null\n+++ b/../x\n@@ -0,0 +1 @@\n+x\n"), 0o644)
	if err := applyDiffFile(dir, p); err == nil {
		t.Fatal("diff escaping the repo must fail")
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), "x")); err == nil {
		t.Fatal("escaped")
	}
}
