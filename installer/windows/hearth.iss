; Inno Setup 6 script for Hearth on Windows (x64).
;
; Build the one-folder bundle first (installer\build.sh in Git Bash, or by hand, see installer\README.md),
; then:   iscc /DAppVersion=0.1.0 installer\windows\hearth.iss
; build.sh runs exactly that when iscc is on PATH, with the version from pyproject.toml.
; Output: dist\hearth-<version>-windows-x86_64-setup.exe
;
; Installs per user by default (no admin prompt; the dialog offers "for all users"), adds Start menu
; and optional desktop shortcuts, optionally puts hearth.exe on the user's PATH. Uninstalling removes
; the program folder only: chats, settings, models and the kernel cache live in %LOCALAPPDATA%\hearth
; and are kept.

#ifndef AppVersion
  #error Pass the version: iscc /DAppVersion=X.Y.Z installer\windows\hearth.iss
#endif

[Setup]
AppId={{6F1D3C52-8E0B-4C8A-9B7E-2D5A4F0C9E11}
AppName=Hearth
AppVersion={#AppVersion}
AppVerName=Hearth {#AppVersion}
AppPublisher=The Hearth maintainers
VersionInfoVersion={#AppVersion}
DefaultDirName={autopf}\Hearth
DefaultGroupName=Hearth
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
OutputDir=..\..\dist
OutputBaseFilename=hearth-{#AppVersion}-windows-x86_64-setup
SetupIconFile=..\art\hearth.ico
UninstallDisplayIcon={app}\hearth-app.exe
UninstallDisplayName=Hearth {#AppVersion}
Compression=lzma2/max
SolidCompression=yes
LZMAUseSeparateProcess=yes
WizardStyle=modern
ChangesEnvironment=yes
CloseApplications=yes

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked
Name: "addtopath"; Description: "Put the hearth command on my PATH"; GroupDescription: "Command line:"; Flags: unchecked

[Files]
; the PyInstaller one-folder bundle: hearth.exe, hearth-app.exe and _internal\
Source: "..\..\build\dist\hearth\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\Hearth"; Filename: "{app}\hearth-app.exe"; Comment: "Chat with language models on your own machine"
Name: "{autodesktop}\Hearth"; Filename: "{app}\hearth-app.exe"; Tasks: desktopicon

[Registry]
Root: HKCU; Subkey: "Environment"; ValueType: expandsz; ValueName: "Path"; ValueData: "{olddata};{app}"; \
    Tasks: addtopath; Check: NeedsAddPath(ExpandConstant('{app}'))

[Run]
Filename: "{app}\hearth-app.exe"; Description: "{cm:LaunchProgram,Hearth}"; Flags: nowait postinstall skipifsilent

[Code]
function NeedsAddPath(Dir: string): Boolean;
var
  Path: string;
begin
  if not RegQueryStringValue(HKEY_CURRENT_USER, 'Environment', 'Path', Path) then
  begin
    Result := True;
    exit;
  end;
  Result := Pos(';' + Uppercase(Dir) + ';', ';' + Uppercase(Path) + ';') = 0;
end;

procedure RemoveFromPath(Dir: string);
var
  Path: string;
  P: Integer;
begin
  if not RegQueryStringValue(HKEY_CURRENT_USER, 'Environment', 'Path', Path) then
    exit;
  P := Pos(';' + Uppercase(Dir), Uppercase(Path));
  if P > 0 then
  begin
    Delete(Path, P, Length(Dir) + 1);
    RegWriteExpandStringValue(HKEY_CURRENT_USER, 'Environment', 'Path', Path);
  end;
end;

procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
begin
  { only the program folder and the PATH entry go; user data in %LOCALAPPDATA%\hearth stays }
  if CurUninstallStep = usPostUninstall then
    RemoveFromPath(ExpandConstant('{app}'));
end;
