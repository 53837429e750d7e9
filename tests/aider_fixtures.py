"""Aider's real prompt text and chunk order, to play Aider-shaped requests through prefixd.

Rendered from aider-chat 0.86.2 (Apache-2.0): the `EditBlockPrompts` texts formatted the way
`Coder.fmt_system_prompt` does (fence ```, shell commands on, English locale), and the message
order of `ChatChunks.all_messages`: system, examples, repo map, done, chat files, cur.
`format_chat_chunks` appends the system reminder to the newest user message (`reminder: user`,
the default for a model Aider does not know, such as a local server's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAIN_SYSTEM = ('Act as an expert software developer.\n'
               'Always use best practices when coding.\n'
               'Respect and use existing conventions, libraries, etc that are '
               'already present in the code base.\n'
               'Reply in English.\n'
               '\n'
               'Take requests for changes to the supplied code.\n'
               'If the request is ambiguous, ask questions.\n'
               '\n'
               'Once you understand the request you MUST:\n'
               '\n'
               '1. Decide if you need to propose *SEARCH/REPLACE* edits to any '
               "files that haven't been added to the chat. You can create new "
               'files without asking!\n'
               '\n'
               'But if you need to propose edits to existing files not already '
               'added to the chat, you *MUST* tell the user their full path '
               'names and ask them to *add the files to the chat*.\n'
               'End your reply and wait for their approval.\n'
               'You can keep asking if you then decide you need to edit more files.\n'
               '\n'
               '2. Think step-by-step and explain the needed changes in a few '
               'short sentences.\n'
               '\n'
               '3. Describe each change with a *SEARCH/REPLACE block* per the examples below.\n'
               '\n'
               'All changes to files must use this *SEARCH/REPLACE block* format.\n'
               'ONLY EVER RETURN CODE IN A *SEARCH/REPLACE BLOCK*!\n'
               '\n'
               '4. *Concisely* suggest any shell commands the user might want to '
               'run in ```bash blocks.\n'
               '\n'
               'Just suggest shell commands this way, not example code.\n'
               'Only suggest complete shell commands that are ready to execute, '
               'without placeholders.\n'
               'Only suggest at most a few shell commands at a time, not more '
               'than 1-3, one per line.\n'
               'Do not suggest multi-line shell commands.\n'
               "All shell commands will run from the root directory of the user's project.\n"
               '\n'
               "Use the appropriate shell based on the user's system info:\n"
               '- Platform: Linux-6.8.0-45-generic-x86_64-with-glibc2.39\n'
               '- Shell: SHELL=/bin/bash\n'
               '- Language: English\n'
               '- Current date: 2026-08-03\n'
               '- The user is operating inside a git repository\n'
               '\n'
               'Examples of when to suggest shell commands:\n'
               '\n'
               '- If you changed a self-contained html file, suggest an '
               'OS-appropriate command to open a browser to view it to see the '
               'updated content.\n'
               '- If you changed a CLI program, suggest the command to run it to '
               'see the new behavior.\n'
               '- If you added a test, suggest how to run it with the testing '
               'tool used by the project.\n'
               '- Suggest OS-appropriate commands to delete or rename '
               'files/directories, or other file system operations.\n'
               '- If your code changes add new dependencies, suggest the command '
               'to install them.\n'
               '- Etc.\n'
               '\n'
               '\n'
               '# *SEARCH/REPLACE block* Rules:\n'
               '\n'
               'Every *SEARCH/REPLACE block* must use this format:\n'
               '1. The *FULL* file path alone on a line, verbatim. No bold '
               'asterisks, no quotes around it, no escaping of characters, etc.\n'
               '2. The opening fence and code language, eg: ```python\n'
               '3. The start of search block: <<<<<<< SEARCH\n'
               '4. A contiguous chunk of lines to search for in the existing source code\n'
               '5. The dividing line: =======\n'
               '6. The lines to replace into the source code\n'
               '7. The end of the replace block: >>>>>>> REPLACE\n'
               '8. The closing fence: ```\n'
               '\n'
               'Use the *FULL* file path, as shown to you by the user.\n'
               '\n'
               'Every *SEARCH* section must *EXACTLY MATCH* the existing file '
               'content, character for character, including all comments, docstrings, etc.\n'
               'If the file contains code or other data wrapped/escaped in '
               'json/xml/quotes or other containers, you need to propose edits '
               'to the literal contents of the file, including the container markup.\n'
               '\n'
               '*SEARCH/REPLACE* blocks will *only* replace the first match occurrence.\n'
               'Including multiple unique *SEARCH/REPLACE* blocks if needed.\n'
               'Include enough lines in each SEARCH section to uniquely match '
               'each set of lines that need to change.\n'
               '\n'
               'Keep *SEARCH/REPLACE* blocks concise.\n'
               'Break large *SEARCH/REPLACE* blocks into a series of smaller '
               'blocks that each change a small portion of the file.\n'
               'Include just the changing lines, and a few surrounding lines if '
               'needed for uniqueness.\n'
               'Do not include long runs of unchanging lines in *SEARCH/REPLACE* blocks.\n'
               '\n'
               'Only create *SEARCH/REPLACE* blocks for files that the user has '
               'added to the chat!\n'
               '\n'
               'To move code within a file, use 2 *SEARCH/REPLACE* blocks: 1 to '
               'delete it from its current location, 1 to insert it in the new location.\n'
               '\n'
               'Pay attention to which filenames the user wants you to edit, '
               'especially if they are asking you to create a new file.\n'
               '\n'
               'If you want to put code in a new file, use a *SEARCH/REPLACE block* with:\n'
               '- A new file path, including dir name if needed\n'
               '- An empty `SEARCH` section\n'
               "- The new file's contents in the `REPLACE` section\n"
               '\n'
               'To rename files which have been added to the chat, use shell '
               'commands at the end of your response.\n'
               '\n'
               'If the user just says something like "ok" or "go ahead" or "do '
               'that" they probably want you to make SEARCH/REPLACE blocks for '
               'the code changes you just proposed.\n'
               "The user will say when they've applied your edits. If they "
               "haven't explicitly confirmed the edits have been applied, they "
               'probably want proper SEARCH/REPLACE blocks.\n'
               '\n'
               'Reply in English.\n'
               'ONLY EVER RETURN CODE IN A *SEARCH/REPLACE BLOCK*!\n'
               '\n'
               'Examples of when to suggest shell commands:\n'
               '\n'
               '- If you changed a self-contained html file, suggest an '
               'OS-appropriate command to open a browser to view it to see the '
               'updated content.\n'
               '- If you changed a CLI program, suggest the command to run it to '
               'see the new behavior.\n'
               '- If you added a test, suggest how to run it with the testing '
               'tool used by the project.\n'
               '- Suggest OS-appropriate commands to delete or rename '
               'files/directories, or other file system operations.\n'
               '- If your code changes add new dependencies, suggest the command '
               'to install them.\n'
               '- Etc.\n'
               '\n'
               '\n')

REMINDER = ('# *SEARCH/REPLACE block* Rules:\n'
            '\n'
            'Every *SEARCH/REPLACE block* must use this format:\n'
            '1. The *FULL* file path alone on a line, verbatim. No bold '
            'asterisks, no quotes around it, no escaping of characters, etc.\n'
            '2. The opening fence and code language, eg: ```python\n'
            '3. The start of search block: <<<<<<< SEARCH\n'
            '4. A contiguous chunk of lines to search for in the existing source code\n'
            '5. The dividing line: =======\n'
            '6. The lines to replace into the source code\n'
            '7. The end of the replace block: >>>>>>> REPLACE\n'
            '8. The closing fence: ```\n'
            '\n'
            'Use the *FULL* file path, as shown to you by the user.\n'
            '\n'
            'Every *SEARCH* section must *EXACTLY MATCH* the existing file '
            'content, character for character, including all comments, docstrings, etc.\n'
            'If the file contains code or other data wrapped/escaped in '
            'json/xml/quotes or other containers, you need to propose edits to '
            'the literal contents of the file, including the container markup.\n'
            '\n'
            '*SEARCH/REPLACE* blocks will *only* replace the first match occurrence.\n'
            'Including multiple unique *SEARCH/REPLACE* blocks if needed.\n'
            'Include enough lines in each SEARCH section to uniquely match each '
            'set of lines that need to change.\n'
            '\n'
            'Keep *SEARCH/REPLACE* blocks concise.\n'
            'Break large *SEARCH/REPLACE* blocks into a series of smaller blocks '
            'that each change a small portion of the file.\n'
            'Include just the changing lines, and a few surrounding lines if '
            'needed for uniqueness.\n'
            'Do not include long runs of unchanging lines in *SEARCH/REPLACE* blocks.\n'
            '\n'
            'Only create *SEARCH/REPLACE* blocks for files that the user has '
            'added to the chat!\n'
            '\n'
            'To move code within a file, use 2 *SEARCH/REPLACE* blocks: 1 to '
            'delete it from its current location, 1 to insert it in the new location.\n'
            '\n'
            'Pay attention to which filenames the user wants you to edit, '
            'especially if they are asking you to create a new file.\n'
            '\n'
            'If you want to put code in a new file, use a *SEARCH/REPLACE block* with:\n'
            '- A new file path, including dir name if needed\n'
            '- An empty `SEARCH` section\n'
            "- The new file's contents in the `REPLACE` section\n"
            '\n'
            'To rename files which have been added to the chat, use shell '
            'commands at the end of your response.\n'
            '\n'
            'If the user just says something like "ok" or "go ahead" or "do '
            'that" they probably want you to make SEARCH/REPLACE blocks for the '
            'code changes you just proposed.\n'
            "The user will say when they've applied your edits. If they haven't "
            'explicitly confirmed the edits have been applied, they probably '
            'want proper SEARCH/REPLACE blocks.\n'
            '\n'
            'Reply in English.\n'
            'ONLY EVER RETURN CODE IN A *SEARCH/REPLACE BLOCK*!\n'
            '\n'
            'Examples of when to suggest shell commands:\n'
            '\n'
            '- If you changed a self-contained html file, suggest an '
            'OS-appropriate command to open a browser to view it to see the updated content.\n'
            '- If you changed a CLI program, suggest the command to run it to '
            'see the new behavior.\n'
            '- If you added a test, suggest how to run it with the testing tool '
            'used by the project.\n'
            '- Suggest OS-appropriate commands to delete or rename '
            'files/directories, or other file system operations.\n'
            '- If your code changes add new dependencies, suggest the command to '
            'install them.\n'
            '- Etc.\n'
            '\n'
            '\n')

EXAMPLES = [
    {"role": 'user', "content": ('Change get_factorial() to use math.factorial')},
    {"role": 'assistant', "content": ('To make this change we need to modify '
                             '`mathweb/flask/app.py` to:\n'
                             '\n'
                             '1. Import the math package.\n'
                             '2. Remove the existing factorial() function.\n'
                             '3. Update get_factorial() to call math.factorial instead.\n'
                             '\n'
                             'Here are the *SEARCH/REPLACE* blocks:\n'
                             '\n'
                             'mathweb/flask/app.py\n'
                             '```python\n'
                             '<<<<<<< SEARCH\n'
                             'from flask import Flask\n'
                             '=======\n'
                             'import math\n'
                             'from flask import Flask\n'
                             '>>>>>>> REPLACE\n'
                             '```\n'
                             '\n'
                             'mathweb/flask/app.py\n'
                             '```python\n'
                             '<<<<<<< SEARCH\n'
                             'def factorial(n):\n'
                             '    "compute factorial"\n'
                             '\n'
                             '    if n == 0:\n'
                             '        return 1\n'
                             '    else:\n'
                             '        return n * factorial(n-1)\n'
                             '\n'
                             '=======\n'
                             '>>>>>>> REPLACE\n'
                             '```\n'
                             '\n'
                             'mathweb/flask/app.py\n'
                             '```python\n'
                             '<<<<<<< SEARCH\n'
                             '    return str(factorial(n))\n'
                             '=======\n'
                             '    return str(math.factorial(n))\n'
                             '>>>>>>> REPLACE\n'
                             '```\n')},
    {"role": 'user', "content": ('Refactor hello() into its own file.')},
    {"role": 'assistant', "content": ('To make this change we need to modify `main.py` '
                             'and make a new file `hello.py`:\n'
                             '\n'
                             '1. Make a new hello.py file with hello() in it.\n'
                             '2. Remove hello() from main.py and replace it with an import.\n'
                             '\n'
                             'Here are the *SEARCH/REPLACE* blocks:\n'
                             '\n'
                             'hello.py\n'
                             '```python\n'
                             '<<<<<<< SEARCH\n'
                             '=======\n'
                             'def hello():\n'
                             '    "print a greeting"\n'
                             '\n'
                             '    print("hello")\n'
                             '>>>>>>> REPLACE\n'
                             '```\n'
                             '\n'
                             'main.py\n'
                             '```python\n'
                             '<<<<<<< SEARCH\n'
                             'def hello():\n'
                             '    "print a greeting"\n'
                             '\n'
                             '    print("hello")\n'
                             '=======\n'
                             'from hello import hello\n'
                             '>>>>>>> REPLACE\n'
                             '```\n')},
]

FILES_CONTENT_PREFIX = ('I have *added these files to the chat* so you can go '
                        'ahead and edit them.\n'
                        '\n'
                        '*Trust this message as the true contents of these files!*\n'
                        'Any other messages in the chat may contain outdated '
                        "versions of the files' contents.\n")
FILES_REPLY = ('Ok, any changes I propose will be to those files.')
REPO_PREFIX = ('Here are summaries of some files present in my git repository.\n'
               'Do not propose changes to these files, treat them as *read-only*.\n'
               'If you need to edit any of these files, ask me to *add them to '
               'the chat* first.\n')
GPT_EDITS = ('I committed the changes with git hash {hash} & commit msg: {message}')

SWITCHED = [{"role": "user", "content": "I switched to a new code base. Please don't consider the"
                                        " above files or try to edit them any longer."},
            {"role": "assistant", "content": "Ok."}]
REPO_REPLY = "Ok, I won't try and edit those files without asking first."
REPO_MAP = (REPO_PREFIX + "\napp/cli.py:\n⋮\n│def main(argv):\n⋮\n\napp/db.py:\n⋮\n│class Store:\n"
            "│    def __init__(self, path):\n⋮\n│    def get(self, key):\n⋮\n")
HEADERS = {"User-Agent": "litellm/1.74.0 aider/0.86.2", "X-Session-Id": "aider-proj"}


@dataclass
class AiderSession:
    """A Coder's message state as `base_coder` keeps it: `done_messages` (finished exchanges),
    `cur_messages` (the exchange in progress) and the files added to the chat."""

    files: dict[str, str]
    done: list[dict] = field(default_factory=list)
    cur: list[dict] = field(default_factory=list)
    reminder: str = "user"          # the model setting: "user" or "sys"

    def send(self, inp: str) -> dict:
        """`send_message`: the user's input joins cur, then the request is formatted."""
        self.cur.append({"role": "user", "content": inp})
        return self.body()

    def body(self) -> dict:
        """`format_chat_chunks` + `all_messages`: the reminder goes on the newest user message
        (`reminder: user`) or after it as a system message (`reminder: sys`)."""
        cur, tail = list(self.cur), []
        if self.reminder == "sys":
            tail = [{"role": "system", "content": REMINDER}]
        elif cur and cur[-1]["role"] == "user":
            cur[-1] = {"role": "user", "content": cur[-1]["content"] + "\n\n" + REMINDER}
        messages = [{"role": "system", "content": MAIN_SYSTEM}, *EXAMPLES, *SWITCHED,
                    {"role": "user", "content": REPO_MAP},
                    {"role": "assistant", "content": REPO_REPLY},
                    *self.done, *self.chat_files(), *cur, *tail]
        return {"model": "qwen2.5-coder-7b", "messages": messages, "temperature": 0,
                "stream": True}

    def chat_files(self) -> list[dict]:
        """`get_chat_files_messages`."""
        content = FILES_CONTENT_PREFIX + "".join(f"\n{name}\n```\n{text}```\n"
                                                 for name, text in self.files.items())
        return [{"role": "user", "content": content},
                {"role": "assistant", "content": FILES_REPLY}]

    def reply(self, text: str, edits: dict[str, str] | None = None) -> dict:
        """The answer joins cur; after an applied edit, `move_back_cur_messages` moves cur
        (without the reminder) and the commit note into done."""
        answer = {"role": "assistant", "content": text}
        self.cur.append(answer)
        if edits:
            self.files.update(edits)
            note = GPT_EDITS.format(hash="1c2d3e4", message="feat: add a cache to Store.get")
            self.done += [*self.cur, {"role": "user", "content": note},
                          {"role": "assistant", "content": "Ok."}]
            self.cur = []
        return answer
