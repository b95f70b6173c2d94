package shape

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// corePackages are the packages whose shape is held, relative to this one.
var corePackages = []string{"../../tunnelcore", "../../caddymodule", "../../agent", "../../l4module", "../route"}

const (
	// maxFunctionLines is the longest a function of the core may be.
	maxFunctionLines = 100
	// maxConnFields is how many fields tunnelcore.Conn may have.
	maxConnFields = 35
)

// parseDir parses the non-test, non-generated Go files of dir.
func parseDir(t *testing.T, dir string) (*token.FileSet, []*ast.File) {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, p := range paths {
		if strings.HasSuffix(p, "_test.go") || strings.HasSuffix(p, ".pb.go") {
			continue
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	if len(files) == 0 {
		t.Fatalf("no Go files in %s", dir)
	}
	return fset, files
}

// TestNoLongFunctions: no function or method of the core packages is
// longer than maxFunctionLines.
func TestNoLongFunctions(t *testing.T) {
	for _, dir := range corePackages {
		fset, files := parseDir(t, dir)
		for _, f := range files {
			for _, d := range f.Decls {
				fd, ok := d.(*ast.FuncDecl)
				if !ok || fd.Body == nil {
					continue
				}
				start, end := fset.Position(fd.Pos()), fset.Position(fd.End())
				if n := end.Line - start.Line + 1; n > maxFunctionLines {
					t.Errorf("%s:%d: %s is %d lines (at most %d): split it into named steps",
						filepath.Base(start.Filename), start.Line, fd.Name.Name, n, maxFunctionLines)
				}
			}
		}
	}
}

// TestConnFields: tunnelcore.Conn has at most maxConnFields fields
// (embedded types count as one).
func TestConnFields(t *testing.T) {
	_, files := parseDir(t, "../../tunnelcore")
	for _, f := range files {
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.TYPE {
				continue
			}
			for _, s := range gd.Specs {
				ts := s.(*ast.TypeSpec)
				st, ok := ts.Type.(*ast.StructType)
				if !ok || ts.Name.Name != "Conn" {
					continue
				}
				n := 0
				for _, field := range st.Fields.List {
					n += max(len(field.Names), 1)
				}
				if n > maxConnFields {
					t.Errorf("tunnelcore.Conn has %d fields (at most %d): group them into the types of their concerns", n, maxConnFields)
				}
				return
			}
		}
	}
	t.Fatal("no type Conn in tunnelcore")
}
