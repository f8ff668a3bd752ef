module github.com/ferrymq/ferry

go 1.23
